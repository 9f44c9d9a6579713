bash .whl/install-on-gpu.sh base >/dev/null 2>&1 && pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1; export PYTHONPATH=$PWD
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,utilization.gpu --format=csv -lms 1000 > $OUT/smi_e2e.csv &
SMI=$!
F="--preset qwen2_5_1_5b --steps 3 --max-tokens 0"
echo "=== $(date +%T) 1.5B fixed packed default"
timeout 110 python scripts/bench/e2e.py $F > $OUT/e2e_fixed_1_5b_packed8.json 2>/dev/null; tail -c 1500 $OUT/e2e_fixed_1_5b_packed8.json
echo "=== $(date +%T) 1.5B fixed padded"
timeout 110 python scripts/bench/e2e.py $F trainer.pack_sequences=false > $OUT/e2e_fixed_1_5b_padded8.json 2>/dev/null; tail -c 1500 $OUT/e2e_fixed_1_5b_padded8.json
L="--preset qwen2_5_0_5b --lengths long_tail --response-len 1024 --fresh-lengths --steps 3 --max-tokens 0"
echo "=== $(date +%T) 0.5B LT 1024 packed default"
timeout 80 python scripts/bench/e2e.py $L > $OUT/e2e_lt1024_0_5b_packed8.json 2>/dev/null; tail -c 1500 $OUT/e2e_lt1024_0_5b_packed8.json
echo "=== $(date +%T) 0.5B LT 1024 padded"
timeout 80 python scripts/bench/e2e.py $L trainer.pack_sequences=false > $OUT/e2e_lt1024_0_5b_padded8.json 2>/dev/null; tail -c 1500 $OUT/e2e_lt1024_0_5b_padded8.json
echo "=== $(date +%T) end"
kill $SMI
