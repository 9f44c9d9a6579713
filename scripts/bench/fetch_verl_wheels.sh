#!/usr/bin/env bash
# Download, on this (CPU) machine, verl 0.9.1 and the wheels of its dependency closure that the GPU image
# lacks (scripts/bench/verl-deps.txt), into .whl/verl/c1..c3 of this checkout: parts of at most 60 MiB, one
# part carried per device call. ray's wheel (76 MiB) is split in two and reassembled there.
#
#   bash scripts/bench/fetch_verl_wheels.sh        # -> .whl/verl/c1 (ray part 1), c2, c3 (~163 MiB in all)
#
# The rollout runs on our vLLM 0.26 (../shared/device/fetch-wheels.sh vllm: verl 0.9.1 checks only
# vllm >= 0.18); verl's `vllm` extra (vllm==0.24.0, torchvision, torchaudio) is not carried.
# On the GPU machine scripts/bench/install_verl_on_gpu.sh stashes the parts and installs them into a venv
# (--system-site-packages: the image's torch 2.11, our vLLM; transformers 5.9.0 there, verl needs < 5.11).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(git rev-parse --show-toplevel)
cd "$root"
git check-ignore -q .whl/x || echo '/.whl/' >> "$(git rev-parse --git-path info/exclude)"
plat=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64
      --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux_2_31_x86_64)
d=.whl/verl
rm -rf "$d" && mkdir -p "$d/full" "$d/c1" "$d/c2" "$d/c3"
pip download -q --no-deps "${plat[@]}" -d "$d/full" -r "$here/verl-deps.txt"
ray=$(cd "$d/full" && ls ray-2.60.0-*.whl)
(cd "$d/full" && sha256sum "$ray" > ../SHA256_ray && split -b 60M -d "$ray" "$ray.part" && rm "$ray")
mv "$d/full/$ray.part00" "$d/c1/"
mv "$d/full/$ray.part01" "$d/SHA256_ray" "$d/c2/"
# The other wheels, largest first, into c2 while it stays under 55 MiB, then c3.
for f in $(ls -S "$d/full"); do
  if [ "$(du -sm "$d/c2" | cut -f1)" -lt 55 ]; then mv "$d/full/$f" "$d/c2/"; else mv "$d/full/$f" "$d/c3/"; fi
done
rmdir "$d/full"
du -sm "$d"/c*
for c in "$d"/c*; do  # the files' bytes (what a call carries), not du's blocks
  [ "$(find "$c" -type f -printf '%s\n' | awk '{s += $1} END {print s}')" -le $((60 << 20)) ] ||
    { echo "$c is over 60 MiB" >&2; exit 1; }
done
