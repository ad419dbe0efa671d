# shellcheck shell=bash
# Sourced by tests/gpu/pack.sh and ab_pack.sh: carry_libs DEST BINARY... copies every shared library
# the binaries load into DEST, except the C runtime, MPI, CUDA and NCCL, which the GPU machine has
# (its own Open MPI 4.1 is used); tests/gpu/carry_env.sh links them in there where a soname is
# missing.
carry_libs() {
  local dest=$1
  shift
  ldd "$@" | awk '/=> \//{print $3}' | sort -u | while read -r lib; do
    case "${lib##*/}" in
      libc.so*|libm.so*|ld-linux*|libmpi.so*|libopen-rte*|libopen-pal*|libstdc++*|libgcc_s*|libpthread*|libdl.so*|librt.so*|libcuda.so*|libnccl.so*|libcudart.so*|libresolv.so*) ;;
      *) cp -L "$lib" "$dest"/ ;;
    esac
  done
}
