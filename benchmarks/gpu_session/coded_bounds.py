"""The checks of engine_bench results of llama3-8b at 8 GiB run with VRAMSHARD_WIRE_CODEC=on before engine_bench
counted the link's coded bytes (session 55, calls 4-5): derived() again over the coded link
(benchmarks.common.coded_link), the CPU's 64-row rate backed out of each run's own additive step bound.

    PYTHONPATH=src:. python benchmarks/gpu_session/coded_bounds.py docs/results-codec_on_*-run55.json
"""
import json
import sys

from benchmarks.engine_bench import derived
from benchmarks.common import coded_link, decode_read_bytes
from vramshard.runtime.wire_codec import RATIO
from vramshard.shapes import shape_model

model = shape_model("llama3-8b")
for f in sys.argv[1:]:
    d = json.load(open(f)); m = d["models"]["llama3-8b"]; bw = d["bandwidth_gb_s"]; a = d["args"]
    ours = next(c for c in m["cells"] if c["engine"] == "vramshard")
    outside = m["bytes"] - ours["resident_bytes"]
    rate = m["checks"]["8GiB_batch64_step_additive_bound_tok_s"] * outside / 64e9 - bw["h2d"]
    checks = derived(m["cells"], m["bytes"], decode_read_bytes(model, a["pp"] + a["tg"] // 2), coded_link(bw, RATIO),
                     {64: rate})
    keys = ("8GiB_batch64_speedup_vs_layers_max", "8GiB_batch64_step_bound_tok_s",
            "8GiB_batch64_step_bound_over_layers_max", "8GiB_batch64_run_bound_over_layers_max", "8GiB_decode_bound_tok_s", "8GiB_decode_fraction_of_bound",
            "8GiB_ttft_bound_s", "8GiB_ttft_over_bound")
    print(f, "cpu 64-row rate %.1f GB/s" % rate, {k.replace("8GiB_", ""): round(checks[k], 3) for k in keys})
