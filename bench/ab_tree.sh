#!/usr/bin/env bash
# Put the runtime packages of an earlier commit beside the working tree for a one-machine A/B on the device:
#     bash bench/ab_tree.sh REV NAME [DIR ...]      (DIRs: default kernels ninfer_rt)
# writes .ab/NAME/<package> (kernels -> ninfer_kernels, formats -> ninfer_formats; git-ignored). Carry ".ab" with
# the run; `SWEEP_VAR=NINFER_AB SWEEP_VALUES="head NAME head NAME" bash bench/gpu_run.sh sweep` then runs every
# value that names a folder .ab/<value> with that folder first on PYTHONPATH (its packages shadow the tree's).
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 2 ] || { echo "usage: bench/ab_tree.sh REV NAME [DIR ...]" >&2; exit 2; }
rev=$1 name=$2; shift 2
case $name in head|*/*|.*) echo "ab_tree: NAME must be a plain folder name other than head" >&2; exit 2;; esac
git rev-parse -q --verify "$rev^{commit}" >/dev/null || { echo "ab_tree: no commit $rev" >&2; exit 2; }
grep -qx '/.ab/' .git/info/exclude 2>/dev/null || echo '/.ab/' >> .git/info/exclude
dirs=("$@"); [ ${#dirs[@]} -gt 0 ] || dirs=(kernels ninfer_rt)
tmp=$(mktemp -d .ab.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
mkdir "$tmp/src" "$tmp/out"
for dir in "${dirs[@]}"; do
  case $dir in kernels) pkg=ninfer_kernels;; formats) pkg=ninfer_formats;; *) pkg=$dir;; esac
  git archive "$rev" "$dir" | tar -x -C "$tmp/src"
  mv "$tmp/src/$dir" "$tmp/out/$pkg"
done
mkdir -p .ab && rm -rf ".ab/$name" && mv "$tmp/out" ".ab/$name"
echo "ab_tree: .ab/$name holds $(ls ".ab/$name" | tr '\n' ' ')from $(git rev-parse --short "$rev"); carry .ab" >&2
