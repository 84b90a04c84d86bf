# gnuplot -e "in='bench/cp_2gpu.dat'; out='bench/cp_2gpu.png'" bench/plot_cp.gp
set terminal pngcairo size 800,500
set output out
set title "KCP: fwd+bwd of one sequence, 1 vs 2 GPUs (bf16, H=16, K=V=128)"
set xlabel "T (tokens)"
set ylabel "ms (median)"
set logscale x 2
set key left top
set grid
plot in using 1:2 with linespoints title "1 GPU", \
     in using 1:3 with linespoints title "2 GPUs, KCP (torchrun-style)", \
     in using 1:4 with linespoints title "2 GPUs, KCP (mpirun)", \
     in using 1:5 with linespoints dashtype 2 title "ideal: half-length run on 1 GPU"
