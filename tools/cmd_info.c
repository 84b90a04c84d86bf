/*
 * tools/cmd_info.c -- `deltagrad info --ckpt FILE`: what a checkpoint holds, as the reference
 * model's config.json (stored in the checkpoint's metadata since format 2; derived from the
 * native config for older checkpoints) or, with --all, every metadata entry.
 */
#include "tools/cli.h"
#include "tools/commands.h"
#include "train/checkpoint.h"

#include <stdio.h>
#include <string.h>

static void usage(FILE *f) {
    fprintf(
        f,
        "usage: deltagrad info --ckpt FILE [--all]\n"
        "\n"
        "Prints the checkpoint's model config as a config.json of the reference model\n"
        "(model_type, hidden_size, num_hidden_layers, num_heads, head_dim, expand_v,\n"
        "vocab_size, safe_gate, lower_bound, use_short_conv, conv_size, ...; deltagrad's own\n"
        "keys under \"deltagrad\"). Format-1 checkpoints, which do not store it, get it derived\n"
        "from their native config.\n"
        "\n"
        "  --ckpt FILE          checkpoint, or a run directory (its ckpt_latest.safetensors)\n"
        "  --all                every metadata entry instead, one \"key = value\" per line\n"
        "                       (the checksums shortened)\n");
}

int dg_cmd_info(int argc, char **argv) {
    static const dg_cli_flag flags[] = {{"--ckpt", "FILE or DIR"}, {"--all", NULL}};
    const char *ckpt = NULL;
    int all = 0;
    dg_cli cli;
    dg_cli_init(&cli, "info", usage, flags, DG_CLI_N(flags), argc, argv);
    const char *f, *v;
    int r;
    while ((r = dg_cli_next(&cli, &f, &v)) == DG_CLI_FLAG) {
        if (!strcmp(f, "--ckpt"))
            ckpt = v;
        else
            all = 1;
    }
    if (r != DG_CLI_END)
        return r;
    if (!ckpt)
        return dg_cli_bad(&cli, "--ckpt", "a checkpoint file or run directory is required");
    char path[DG_PATH_MAX + 64];
    dg_cmd_ckpt_path(ckpt, path, sizeof path);
    dg_ctx *ctx = NULL;
    dg_ckpt ck;
    memset(&ck, 0, sizeof ck);
    dg_status s = dg_ctx_new(dg_cpu(), &ctx);
    if (s == DG_OK)
        s = dg_ckpt_load(ctx, path, &ck);
    if (s != DG_OK) {
        fprintf(stderr, "deltagrad info: --ckpt %s: %s\n", path, dg_last_error());
    } else if (all) {
        for (int i = 0; i < ck.st.n_meta; i++) {
            const char *key = ck.st.meta_keys[i], *val = ck.st.meta_values[i];
            if (!strcmp(key, "checksums") && strlen(val) > 60)
                printf("%s = %.60s... (%zu bytes)\n", key, val, strlen(val));
            else
                printf("%s = %s\n", key, val);
        }
    } else {
        const char *stored = dg_safetensors_meta(&ck.st, "config.json");
        char buf[4096];
        if (stored)
            fputs(stored, stdout);
        else if ((s = dg_model_config_to_ref_json(&ck.cfg, buf, sizeof buf)) == DG_OK)
            fputs(buf, stdout);
        else
            fprintf(stderr, "deltagrad info: %s\n", dg_last_error());
    }
    dg_ckpt_free(&ck);
    dg_ctx_free(&ctx);
    return s == DG_OK ? 0 : 1;
}
