"""tools.train_stops follows `fastformer train` to its first optimizer step: the instrument finds
the stops and the checks run again, and the train wing runs each check once."""

import json

from tools import train_stops


def test_the_job_reaches_its_first_step_running_each_check_once(tmp_path, capsys):
    report = train_stops.main(["--json", str(tmp_path / "stops.json")])
    assert json.loads((tmp_path / "stops.json").read_text()) == report
    functions = report["per_function"]
    for stop in ("cli.py:_train", "train/run.py:check_inputs", "train/run.py:settle"):
        assert f"fastformer/{stop}" in functions, stop
    assert report["stops"] == sum(report["per_file"].values()) == sum(functions.values())
    assert report["files"] == len(report["per_file"])
    assert not any("<" in name for name in functions), "comprehensions are not stops"
    assert report["checks_run_again"] == {}
    assert "checks run again on the same arguments: none" in capsys.readouterr().out


def test_a_check_called_again_on_the_same_arguments_is_reported():
    """report() counts a check again only for the same arguments: check_values of two options is two checks."""
    stops = [
        ("fastformer/train/run.py", "check_values", (("values", "--amp"),)),
        ("fastformer/train/run.py", "check_values", (("values", "--backend"),)),
        ("fastformer/train/job.py", "check_fits", (("config", 1),)),
        ("fastformer/train/job.py", "check_fits", (("config", 1),)),
        ("fastformer/train/job.py", "_train", None),
    ]
    report = train_stops.report(stops)
    assert report["checks_run_again"] == {"fastformer/train/job.py:check_fits": 1}
    assert (report["stops"], report["files"]) == (5, 2)
