#!/usr/bin/env bash
# Runs ON the GPU machine, from the checkout root: installs the verl parts that scripts/bench/fetch_verl_wheels.sh
# put in .whl/verl/c1..c3 (one part carried per call).
#   bash scripts/bench/install_verl_on_gpu.sh stash    # calls with c1 or c2: keep the carried part in /root
#   bash scripts/bench/install_verl_on_gpu.sh install  # the call with c3: reassemble ray, build the venv
# The venv (/root/verl-venv, --system-site-packages) sees the image's torch 2.11 and our vLLM 0.26; pip's
# resolver installs there, offline, what the image lacks or has in a version verl refuses (transformers 5.17:
# verl 0.9.1 needs >=5.5.3,<5.11, so 5.9.0). If the resolver fails (a requirement the image lacks that is not
# carried), every carried wheel is installed with --no-deps instead and the resolver's error is printed.
set -euo pipefail
stash=/root/verl-parts venv=/root/verl-venv
mkdir -p "$stash"
for d in .whl/verl/c*/; do [ -d "$d" ] && cp "$d"* "$stash"/; done
case "${1:-install}" in
stash) ls "$stash" | wc -l ;;
install)
  cd "$stash"
  if ls ray-*.whl.part0* > /dev/null 2>&1; then
    ray=$(ls ray-*.whl.part00 | sed 's/\.part00$//')
    cat "$ray".part0* > "$ray" && sha256sum -c SHA256_ray && rm -f "$ray".part0*
  fi
  [ -x "$venv/bin/python" ] || python3 -m venv --system-site-packages "$venv"
  # The image's packages (numpy, torch, our vLLM, hydra) need not live where the venv's system-site-packages
  # looks (measured: the venv saw no numpy): list the image interpreter's package folders in a .pth, after
  # the venv's own (so the venv's transformers 5.9 wins over the image's 5.17).
  python3 -c 'import sys; print("\n".join(p for p in sys.path if p.endswith(("site-packages", "dist-packages"))))' \
    > "$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_image_site.pth"
  if ! "$venv/bin/pip" install -q --no-index --find-links "$stash" verl==0.9.1 transformers==5.9.0 \
    tensordict==0.10.0 2> "$stash/resolver.err"; then
    cat "$stash/resolver.err" >&2
    echo "install_verl_on_gpu: the resolver failed; installing the carried wheels with --no-deps" >&2
    "$venv/bin/pip" install -q --no-index --no-deps "$stash"/*.whl
  fi
  "$venv/bin/python" -c "import verl, transformers, tensordict, ray, vllm, torch; print('verl', verl.__version__,
'transformers', transformers.__version__, 'tensordict', tensordict.__version__, 'ray', ray.__version__,
'vllm', vllm.__version__, 'torch', torch.__version__)" ;;
*) echo "usage: $0 stash|install" >&2; exit 2 ;;
esac
