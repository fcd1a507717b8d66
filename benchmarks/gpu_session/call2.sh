# ~8 min: the nemo-8b grid at 8 and 2 GiB (decode at 1K context against the paper's 12.4 and 7.6
# tok/s, batch 64, TTFT, and layers:max at both budgets), planned from PROFILE, prepacked CPU
# weights as the switches in the environment say (none: the compiled projections).
source benchmarks/gpu_session/setup.sh || exit 1
source benchmarks/gpu_session/engine_grid.sh; engine_grid nemo-8b 8,2 400 450
