# Sourced by the scripts that run on the GPU machine (device_run.sh, kernel_times.sh, ncu_probe.sh),
# from the repository root: unpack carry/pkg.tgz (tests/gpu/pack.sh) afresh, since a warm machine
# keeps an older carry/gpu, and link each carried library in only where the machine lacks its
# soname (its own CUDA, NCCL and MPI stay in charge); $OUT is made.
[ -f carry/pkg.tgz ] && tar -C carry -xzf carry/pkg.tgz
FILL=/tmp/ds-fill; mkdir -p $FILL
for f in carry/lib/*; do so=${f##*/}; /sbin/ldconfig -p | grep -q "^[[:space:]]*$so " || ln -sf "$PWD/$f" $FILL/$so; done
export LD_LIBRARY_PATH=$FILL${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
