#!/usr/bin/env bash
# Issue 50's GPU items in one device call, the most wanted first, each under what is left of
# DEADLINE seconds (default 540: the device tool's 600 s a call, less the copying). Run on the
# device machine from the repository's root, its image's JAX, flax and optax as they are, and
# the wheels in .whl (ignored by git; carry it) of what the image lacks: jmp, made here with
# `pip download --no-deps -d .whl jmp==0.0.4` (pure Python):
#
#   OUT=$OUT bash benchmarks/gpu_session.sh      # DEADLINE=... to change the budget
#
# It writes into $OUT (the folder the device tool brings back): device.txt (nvidia-smi's name,
# memory and driver; JAX's version and devices), gpu_tests.txt (`pytest -m gpu`: the fused
# kernel against the chain; and the host-state streamed step's exact twins in
# tests/test_streamed.py, for openxla/xla #46231), gpu_speed.jsonl and .txt
# (`gpu_validate.py --speed`'s Llama-3.1-8B rows, with and without the fused update: tokens/s),
# gpu_profile.md (`gpu_profile.py`: where the 8B's streamed steps spend their time). Then, on
# the machine without a GPU: append gpu_speed.jsonl's rows to docs/gpu.jsonl, run
# `benchmarks/step_time.py` for each estimate beside its measurement, and write the figures
# into docs/gpu.md with the device's name. DRY_RUN=1 runs the same on the CPU at tiny sizes
# (no nvidia-smi, no GPU tests), which tests/test_gpu_session.py does. DEADLINE: whole seconds.
set -u
out=${OUT:?set OUT to the folder to write into}
deadline=${DEADLINE:-540}
dry=$([ "${DRY_RUN:-0}" = 1 ] && echo --dry-run)
start=$SECONDS
left() { local s=$((deadline - (SECONDS - start))); echo $((s > 1 ? s : 1)); }
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} XLA_PYTHON_CLIENT_PREALLOCATE=false
python=${PYTHON:-python3}
mkdir -p "$out"
if [ -d .whl ] && [ -z "$dry" ]; then
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi

if [ -z "$dry" ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$out/device.txt"
  # A test module whose imports the device image lacks is reported, the others still run.
  timeout "$(($(left) / 4))" "$python" -m pytest -q -m gpu -p no:cacheprovider \
    --continue-on-collection-errors tests > "$out/gpu_tests.txt" 2>&1
  echo "pytest -m gpu: exit $? after $((SECONDS - start)) s" >> "$out/gpu_tests.txt"
  timeout "$(($(left) / 8))" "$python" -m pytest -q -p no:cacheprovider tests/test_streamed.py \
    -k "host_give_the_same_step or a_layer_in_parts" >> "$out/gpu_tests.txt" 2>&1
  echo "pytest test_streamed's twins: exit $? after $((SECONDS - start)) s" \
    >> "$out/gpu_tests.txt"
fi
"$python" -c "import jax; print('jax', jax.__version__, jax.devices())" >> "$out/device.txt" 2>&1

models=${dry:+llama-tiny}
# Each part under `timeout` too: a script's own deadline starts after JAX's start-up. A case
# finished is in $OUT at once (gpu_profile.md after each case; gpu_speed.jsonl a row a case).
# The speed rows first: no program `plan` picks now has run on a GPU (session 50), and the
# issue's two measured targets are their first two rows; then the profile.
budget=$(($(left) / 2))
timeout "$budget" "$python" benchmarks/gpu_validate.py --speed --cases-only $dry \
  --models "${models:-llama-3.1-8b}" --repeats 3 --rows "$out/gpu_speed.jsonl" \
  --deadline "$((budget - 10))" > "$out/gpu_speed.txt" 2>&1
echo "gpu_validate --speed: exit $? after $((SECONDS - start)) s" >> "$out/gpu_speed.txt"

budget=$(left)
timeout "$budget" "$python" benchmarks/gpu_profile.py $dry --models "${models:-llama-3.1-8b}" \
  --steps 2 --out "$out/gpu_profile.md" --traces "${TMPDIR:-/tmp}/gpu_session_traces" \
  --deadline "$((budget - 10))" > "$out/gpu_profile.txt" 2>&1
echo "gpu_profile: exit $? after $((SECONDS - start)) s" >> "$out/gpu_profile.txt"
