"""One line per cell of an ``engine_bench`` JSON, for a GPU call's output: engine, budget, decode
tok/s, batched tok/s, the cell's seconds, its load phases, decode measured over predicted, its TTFT runs
and stalls (slowest decode step ms, decode steps over twice the median, slowest prompt step ms), the
attention layers whose KV cache is in VRAM at the end ("kv N"), the host's read GB/s before and after it
("read A-B"), the cores other processes kept busy over it and the steal among them ("beside O/S"), its round
under --abba, any error; then the model's checks.

    python3 benchmarks/gpu_session/engine_summary.py $OUT/nemo_decode.json
"""

import json
import sys


def main(path: str) -> None:
    data = json.load(open(path))
    print(data.get("bandwidth_gb_s"))
    for model in data["models"].values():
        for cell in model["cells"]:
            batched = {size: round(run.get("tok_s", 0), 1) for size, run in (cell.get("batched") or {}).items()}
            load = {phase: round(s, 1) for phase, s in (cell.get("load_seconds") or {}).items()}
            ttft = [round(t, 3) for t in cell.get("ttft_runs_s") or []]
            stalls = [cell.get(k) and round(cell[k], 1) for k in
                      ("decode_step_ms_max", "decode_steps_over_2x_median", "prompt_step_ms_max")]
            read = "-".join(f"{r:.0f}" for r in cell.get("host_read_gb_s") or [])
            beside = cell.get("host_beside_cores")
            print(cell.get("engine"), cell.get("vram"), cell.get("tg_tok_s"), batched, cell.get("cell_s"), load,
                  (cell.get("decode_vs_plan") or {}).get("measured_over_predicted"), ttft, stalls,
                  f"kv {cell.get('kv_layers_in_vram_at_end')}", f"read {read}" if read else "",
                  f"beside {beside['others']:.2f}/{beside['steal']:.2f}" if beside else "",
                  f"round {cell['round']}" if cell.get("round") else "", cell.get("error", ""))
        print(model.get("checks"))


if __name__ == "__main__":
    main(sys.argv[1])
