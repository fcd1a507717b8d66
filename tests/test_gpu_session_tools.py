"""The GPU session's log helpers (benchmarks/gpu_session/), on logs written the way engine_bench writes them."""

from benchmarks.gpu_session import switches_after_warmup

LOG = """\
2026-12-06 20:37:45,105 the CPU work of plan planned(1:search@1) took {1: 71.1} where {1: 62.0} was predicted: planning again
2026-12-06 20:37:50,448 reconfigured to search@1: 43 resident
2026-12-06 20:37:52,656 warm-up done after 2 round(s): plan planned(1:search@1) in force, no plan awaited
2026-12-06 20:37:52,837 the CPU work of plan planned(1:search@1) took {1024: 12.0} where {1024: 16.4} was predicted: fitted the profile's CPU factors by rows to {1024: 0.731}; planning again with them in the background
2026-12-06 20:37:53,568 reconfigured to split@1: 21 resident
2026-12-06 20:37:58,998 llama3-8b vramshard 8589934592: {'placement': 'planned(1:search@1)', 'ttft_s': 0.2}
2026-12-06 20:38:11,472 llama3-8b layers:max 8589934592: {'placement': 'layers:17', 'ttft_s': 1.98}
2026-12-06 20:38:20,000 warm-up done after 1 round(s): plan planned(1:search@1) in force, no plan awaited
2026-12-06 20:38:21,000 the quick plan after the calibrate is predicted at 90.0 ms a one-token step against 91.0 ms for the plan in force: the plan in force goes on until the full plan
2026-12-06 20:38:41,128 llama3-8b vramshard 8589934592: {'placement': 'planned(1:search@1)', 'ttft_s': 0.2}
"""


def test_only_what_came_after_a_cells_warm_up_is_counted_against_it():
    planned, baseline, second = switches_after_warmup.cells(LOG.splitlines())
    assert planned["cell"] == "vramshard 8589934592" and planned["warmed"]
    assert [line[24:40] for line in planned["after"]] == ["the CPU work of ", "reconfigured to "]
    assert baseline == {"cell": "layers:max 8589934592", "warmed": False, "after": []}
    assert second["warmed"] and len(second["after"]) == 1 and "goes on" in second["after"][0]
