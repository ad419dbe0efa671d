#!/usr/bin/env bash
# Pack the step benchmark of several revisions for one A/B call on the GPU machine (the device
# tool; carry ["carry/ab.tgz"]; tests/gpu/ab_run.sh is the other half). Each LABEL=REV (a commit,
# a branch, or "." for the working tree as it is) is built in its own git worktree under tmp/ab/
# (the working tree in place), and its bench_step, stripped, goes to carry/ab/LABEL/; the first
# one's bench_linear_cuda, which measures the card's copy bandwidth, goes along. The binaries then
# alternate in one call, on one card: the device tool lends different cards from call to call, so
# only numbers from the same call compare (PERFORMANCE_HISTORY.md). REV:PATCH builds REV with a
# patch applied (git apply, the path from this checkout's root): the experiments kept as patches
# in results/experiments/, which later checkouts hold where the branches they came from are gone.
#   bash tests/gpu/ab_pack.sh main=HEAD new=.
#   bash tests/gpu/ab_pack.sh main=HEAD diag=HEAD:results/experiments/cta_trace_efa1ca7.patch
#   then, on the device: bash tests/gpu/ab_run.sh   (see there for REPS and BENCH_ARGS)
# Each worktree's build is kept in tmp/ab/LABEL (make is incremental on the next pack of that
# label); `git worktree prune` after removing tmp/ab forgets them.
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ $# -lt 1 ]; then
  echo "usage: ab_pack.sh LABEL=REV[:PATCH] [LABEL=REV[:PATCH] ...]   (REV: a commit or branch, or . for the working tree)" >&2
  exit 2
fi
C=carry
rm -rf $C/ab $C/ab.tgz
mkdir -p $C/ab $C/lib tmp/ab
labels=()
for spec in "$@"; do
  label=${spec%%=*}
  rev=${spec#*=}
  if [ "$label" = "$spec" ] || [ -z "$label" ] || [ -n "${label//[A-Za-z0-9._+-]/}" ]; then
    echo "ab_pack.sh: '$spec' is not LABEL=REV with a label of letters, digits and . _ + -" >&2
    exit 2
  fi
  patch=
  if [ "${rev#*:}" != "$rev" ]; then
    patch=${rev#*:}
    rev=${rev%%:*}
    [ -f "$patch" ] || { echo "ab_pack.sh: $label: no patch file '$patch'" >&2; exit 2; }
    patch=$(realpath "$patch")
    [ "$rev" != . ] || { echo "ab_pack.sh: $label: a patch goes with a revision, not the working tree" >&2; exit 2; }
  fi
  if [ "$rev" = . ]; then
    dir=$PWD
  else
    dir=$PWD/tmp/ab/$label
    sha=$(git rev-parse --verify "$rev^{commit}") || { echo "ab_pack.sh: $label: no revision '$rev'" >&2; exit 2; }
    if [ -d "$dir" ]; then
      # a patch applied by the last pack of this label: its changes, and the files it added (the
      # ignored build stays)
      git -C "$dir" reset -q --hard
      git -C "$dir" clean -fdq
      git -C "$dir" checkout -q --detach "$sha"
    else
      git worktree add -q --detach "$dir" "$sha"
    fi
    if [ -n "$patch" ]; then
      git -C "$dir" apply "$patch" || { echo "ab_pack.sh: $label: $patch does not apply to $rev" >&2; exit 1; }
    fi
  fi
  echo "ab_pack.sh: $label = $rev${patch:+ + $patch} ($(git -C "$dir" rev-parse --short HEAD)$( [ "$rev" = . ] && ! git diff --quiet HEAD && echo ", with uncommitted changes"))"
  make -C "$dir" -j"$(nproc)" build/bench/bench_step build/bench/bench_linear_cuda > "tmp/ab/$label.build.log" 2>&1 ||
    { echo "ab_pack.sh: $label: the build failed, see tmp/ab/$label.build.log" >&2; exit 1; }
  mkdir -p "$C/ab/$label"
  cp "$dir/build/bench/bench_step" "$C/ab/$label/"
  [ ${#labels[@]} -eq 0 ] && cp "$dir/build/bench/bench_linear_cuda" $C/ab/
  # the timeline's injection library (tests/gpu/step_timeline.sh), where the revision builds it
  [ ${#labels[@]} -eq 0 ] && make -C "$dir" build/bench/libcupti_trace.so >> "tmp/ab/$label.build.log" 2>&1 &&
    cp "$dir/build/bench/libcupti_trace.so" $C/ab/
  labels+=("$label")
done
strip $C/ab/*/bench_step $C/ab/bench_linear_cuda
printf '%s\n' "${labels[@]}" > $C/ab/LABELS
# the libraries the binaries load that the GPU machine may lack
. tests/gpu/carry_libs.sh
carry_libs $C/lib $C/ab/*/bench_step $(ls $C/ab/libcupti_trace.so 2>/dev/null)
tar -C $C -czf $C/ab.tgz ab lib
du -sh $C/ab.tgz
if [ "$(stat -c %s $C/ab.tgz)" -gt $((64 << 20)) ]; then
  echo "ab_pack.sh: $C/ab.tgz is larger than the device tool's 64 MiB: fewer revisions a call" >&2
  exit 1
fi
