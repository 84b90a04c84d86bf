# cmake/build_info.cmake -- writes dg_build_info.h, the build facts tensor/version.c returns.
# Run at every build (the dg_build_info target), so the commit follows the checkout without a
# reconfigure; the file is rewritten only when its content changes.
#
#   cmake -DDG_SOURCE_DIR=... -DDG_OUT=.../dg_build_info.h -DDG_VERSION_NUMBER=900
#         -DDG_CUDA_ARCHS="90" [-DDG_GIT_COMMIT=...] -P cmake/build_info.cmake
#
# The commit: DG_GIT_COMMIT when given (builds from a source archive), else `git rev-parse` of
# the source tree when it is the top of a git checkout ("-dirty" appended when tracked files
# differ from HEAD), else "unknown".
set(commit "unknown")
if(DG_GIT_COMMIT)
  set(commit "${DG_GIT_COMMIT}")
else()
  find_package(Git QUIET)
  if(GIT_FOUND)
    execute_process(COMMAND ${GIT_EXECUTABLE} -C ${DG_SOURCE_DIR} rev-parse --show-toplevel
                    RESULT_VARIABLE rc OUTPUT_VARIABLE top
                    OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    if(rc EQUAL 0)
      file(REAL_PATH "${top}" top)
      file(REAL_PATH "${DG_SOURCE_DIR}" src)
    endif()
    if(rc EQUAL 0 AND top STREQUAL src)
      execute_process(COMMAND ${GIT_EXECUTABLE} -C ${DG_SOURCE_DIR} rev-parse --short=12 HEAD
                      RESULT_VARIABLE rc OUTPUT_VARIABLE head
                      OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
      if(rc EQUAL 0 AND head)
        set(commit "${head}")
        execute_process(COMMAND ${GIT_EXECUTABLE} -C ${DG_SOURCE_DIR} diff --quiet HEAD --
                        RESULT_VARIABLE dirty OUTPUT_QUIET ERROR_QUIET)
        if(dirty EQUAL 1)
          string(APPEND commit "-dirty")
        endif()
      endif()
    endif()
  endif()
endif()
string(REPLACE ";" "," archs "${DG_CUDA_ARCHS}")
if(NOT archs)
  set(archs "none")
endif()
set(text "/* Written by cmake/build_info.cmake at build time; do not edit. */
#define DG__BUILD_VERSION_NUMBER ${DG_VERSION_NUMBER}
#define DG__BUILD_COMMIT \"${commit}\"
#define DG__BUILD_CUDA_ARCHS \"${archs}\"
")
set(old "")
if(EXISTS "${DG_OUT}")
  file(READ "${DG_OUT}" old)
endif()
if(NOT old STREQUAL text)
  file(WRITE "${DG_OUT}" "${text}")
endif()
