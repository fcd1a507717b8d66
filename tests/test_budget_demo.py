"""The budget demo's bookkeeping (its GPU run is a benchmark): reaction times and crowding are
read on one clock from the two processes' records."""

from benchmarks.budget_demo import over_the_card, reactions, time_over_the_card

GiB = 2**30


def test_reaction_runs_from_the_other_applications_phase_start_to_our_release():
    t0 = 1000.0
    theirs = [{"t": 1000.0, "event": "phase start", "phase": 0, "gib": 0.0},
              {"t": 1012.0, "event": "phase start", "phase": 1, "gib": 10.0},
              {"t": 1024.0, "event": "phase start", "phase": 2, "gib": 0.0}]
    events = [  # recorded when the reconfiguration ended; VRAM released adapt_s - release_s earlier
        {"why": "auto", "time": 1013.5, "adapt_s": 1.0, "release_s": 0.7, "budget": 5 * GiB, "time_to_release_s": 0.8},
        {"why": "refine", "time": 1014.0, "adapt_s": 0.1, "release_s": 0.05, "budget": 5 * GiB, "time_to_release_s": 0.1},
        # The engine fitting its profile and re-planning is not a reaction to the other application.
        {"why": "calibrate", "time": 1024.5, "budget": 5 * GiB, "placements_kept": True},
        {"why": "auto", "time": 1025.0, "adapt_s": 0.3, "release_s": 0.1, "budget": 15 * GiB, "time_to_release_s": 0.4},
    ]
    rows = reactions(theirs, events, t0)
    assert [r["phase"] for r in rows] == [0, 1, 2]
    assert "reaction_s" not in rows[0]  # nothing changed in the first phase
    assert abs(rows[1]["reaction_s"] - 1.2) < 1e-9 and rows[1]["t"] == 12.0
    assert abs(rows[2]["reaction_s"] - 0.8) < 1e-9 and rows[2]["budget"] == 15 * GiB


def test_over_the_card_counts_both_processes_at_each_of_our_samples():
    ours = [{"t": 1.0, "reserved": 14 * GiB, "nvml": None}, {"t": 3.0, "reserved": 14 * GiB, "nvml": None},
            {"t": 5.0, "reserved": 4 * GiB, "nvml": None}]
    theirs = [{"t": 0.5, "reserved": 0, "nvml": None}, {"t": 2.5, "reserved": 10 * GiB, "nvml": None},
              {"t": 2.6, "event": "phase", "phase": 1, "gib": 10.0}]
    assert over_the_card(ours, theirs, 16 * GiB) == [3.0]


def test_time_over_the_card_runs_from_each_crowded_sample_to_the_next():
    vram = [{"t": t} for t in (1.0, 1.5, 2.0, 2.5, 3.0)]
    assert time_over_the_card(vram, [1.5, 2.0]) == 1.0  # 1.5 -> 2.0 -> 2.5
    assert time_over_the_card(vram, [3.0]) == 0.0  # the last sample stands for no time
    assert time_over_the_card(vram, []) == 0.0


def test_a_grown_budget_reacts_at_once_and_reports_when_its_full_plan_came_in():
    t0 = 1000.0
    theirs = [{"t": 1000.0, "event": "phase start", "phase": 0, "gib": 10.0},
              {"t": 1012.0, "event": "phase start", "phase": 1, "gib": 0.0}]
    events = [{"why": "auto", "time": 1012.3, "adapt_s": 0.0, "release_s": 0.0, "budget": 15 * GiB,
               "time_to_release_s": 0.3, "deferred": True},
              {"why": "refine", "time": 1013.5, "adapt_s": 0.2, "release_s": 0.01, "budget": 15 * GiB,
               "time_to_release_s": 0.01}]
    grown = reactions(theirs, events, t0)[1]
    assert abs(grown["reaction_s"] - 0.3) < 1e-9 and abs(grown["full_plan_in_force_s"] - 1.5) < 1e-9
