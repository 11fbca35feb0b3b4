"""A checkpoint is data, not code: loading runs nothing from the files (forged pickles in
DCP's .metadata and in our metadata entries, the manifest recomputed to match), and
fuzzed files load exactly or fail naming the file, leaving the model as it was."""
from harness import run_distributed
from harness import trust_workers as TW

FUZZ_CASES = 240


def test_forged_pickles_run_no_code(tmp_path):
    run_distributed(TW.pickle_attacks, 2, str(tmp_path), timeout=240)


def test_fuzzed_checkpoints_load_exactly_or_fail_naming_the_file(tmp_path):
    out = run_distributed(TW.fuzz_checkpoint, 2, str(tmp_path), FUZZ_CASES, 0, timeout=600)[0]
    print(f"fuzzed {FUZZ_CASES} cases over files {out['files']}: {out['counts']}")
    assert not out["bad"], f"{len(out['bad'])} of {FUZZ_CASES} cases: " + "\n".join(out["bad"][:10])
    assert sum(out["counts"].values()) == FUZZ_CASES
    assert out["counts"]["error_naming_file"] > 0 and out["counts"]["equal"] >= 0


def test_extra_state_is_saved_only_when_it_loads_without_code(tmp_path):
    run_distributed(TW.extra_state_allow_list, 2, str(tmp_path), timeout=240)


def test_checkpoints_of_the_pickled_format_still_load_or_are_refused(tmp_path):
    run_distributed(TW.legacy_format, 2, str(tmp_path), timeout=240)
