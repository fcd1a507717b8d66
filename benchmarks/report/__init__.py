"""The benchmark report of issue 11: the paper's Table 4 / Figure 2, Table 9 / Figure 7 and
Table 8 on the GPU machine, in parts of under 9 minutes each, merged into docs/BENCHMARKS.md.

    python -m benchmarks.report --part NAME --out $OUT        # one part, JSON report-NAME.json
    python -m benchmarks.report --merge DIR... --md docs/BENCHMARKS.md --charts docs/charts/

Modules: ``parts`` (the split and its time estimates), ``grids`` / ``measure`` / ``vlm_part`` /
``run`` (the GPU side), ``record`` (the part JSON), ``results`` / ``sections`` / ``narrative`` /
``repro`` / ``charts`` / ``tables`` / ``merge`` (the merge, CPU only).
"""
