"""`dpzero budget` / `dpzero calibrate` as a user runs them (a real subprocess), checked against
the published reference values."""

import json
import subprocess
import sys

import pytest


def run(*args):
    return subprocess.run([sys.executable, "-m", "dpzero", *args], capture_output=True, text=True,
                          timeout=300)


@pytest.mark.job
def test_budget_json_matches_published_values(tmp_path, accounting_cases):
    rdp_case = accounting_cases["rdp_epsilon"][0]  # q=0.04, σ=1.5, 2250 steps, Opacus grid
    png = tmp_path / "eps.png"
    res = run("budget", "-q", str(rdp_case["q"]), "-s", str(rdp_case["sigma"]), "--steps",
              str(rdp_case["steps"]), "--delta", str(rdp_case["delta"]), "--json", "--plot", str(png))
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    by_name = {r["accountant"]: r for r in out["results"]}
    assert by_name["rdp"]["epsilon"] == pytest.approx(rdp_case["epsilon"], abs=rdp_case["abs_tol"])
    assert by_name["rdp"]["best_order"] == pytest.approx(rdp_case["best_order"])
    prv = by_name["prv"]
    assert prv["lower"] <= prv["estimate"] <= prv["epsilon"] <= by_name["rdp"]["epsilon"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.job
def test_budget_table_prv_upper_bound(accounting_cases):
    case = accounting_cases["prv_epsilon_upper"][0]  # q=0.04, σ=1.5, 2249 steps
    res = run("budget", "-q", "0.04", "-s", "1.5", "--steps", "2249", "--delta", "1e-5",
              "--accountant", "prv")
    assert res.returncode == 0, res.stderr
    line = next(l for l in res.stdout.splitlines() if l.startswith("prv"))
    assert float(line.split()[1]) == pytest.approx(case["epsilon"], abs=case["abs_tol"])


@pytest.mark.job
def test_epochs_convert_like_opacus():
    # Opacus's get_noise_multiplier uses steps = int(epochs / q): 90 / 0.04 -> 2250.
    res = run("budget", "-q", "0.04", "-s", "1.5", "--epochs", "90", "--delta", "1e-5",
              "--accountant", "rdp")
    assert res.returncode == 0, res.stderr
    assert "steps = 2250" in res.stdout


@pytest.mark.job
def test_calibrate_prints_reference_sigma(accounting_cases):
    case = accounting_cases["rdp_noise_multiplier"][1]  # the case given in steps
    res = run("calibrate", "--target-epsilon", str(case["target_epsilon"]), "--delta",
              str(case["delta"]), "-q", str(case["q"]), "--steps", str(case["steps"]),
              "--accountant", "rdp", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["noise_multiplier"] == pytest.approx(case["sigma"], abs=case["abs_tol"])
    assert out["steps"] == case["steps"]  # it says what it calibrated for


@pytest.mark.job
def test_calibrate_from_epochs_says_the_steps_it_used():
    res = run("calibrate", "--target-epsilon", "3", "--delta", "1e-5", "-q", "0.004",
              "--epochs", "30")
    assert res.returncode == 0, res.stderr
    assert "for 7500 steps" in res.stdout  # int(30 / 0.004), Opacus's convention


@pytest.mark.job
def test_bad_values_exit_2_naming_the_value():
    res = run("budget", "-q", "1.7", "-s", "1.0", "--steps", "10", "--delta", "1e-5")
    assert res.returncode == 2
    assert "1.7" in res.stderr
    res = run("budget", "-q", "0.1", "-s", "1.0", "--steps", "10", "--delta", "1e-5",
              "--accountant", "moments")
    assert res.returncode == 2 and "moments" in res.stderr
    res = run("calibrate", "--target-epsilon", "1", "--delta", "1e-5", "-q", "0.1")
    assert res.returncode == 2 and "exactly one of --steps and --epochs" in res.stderr
    res = run("budget", "-q", "0", "-s", "1.0", "--epochs", "2", "--delta", "1e-5")
    assert res.returncode == 2 and "--sample-rate must be in (0, 1] with --epochs, got 0.0" \
        in res.stderr


@pytest.mark.job
def test_a_corrupt_ledger_is_a_bad_file_exit_2(tmp_path):
    (tmp_path / "ledger.jsonl").write_text("garbage\n")
    res = run("report", str(tmp_path))
    assert res.returncode == 2 and "ledger.jsonl line 1" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr


def test_accounting_results_print_their_values():
    import dpzero
    acc = dpzero.PRVAccountant()
    acc.step(noise_multiplier=1.0, sample_rate=0.01, num_steps=100)
    b = acc.epsilon_bounds(1e-5)
    assert repr(b) == (f"PrvEpsilon(lower={b.lower!r}, estimate={b.estimate!r}, "
                       f"upper={b.upper!r})")
    assert b.lower <= b.estimate <= b.upper


@pytest.mark.job
def test_prv_refusal_is_null_in_json_and_exit_3_in_calibrate():
    # δ = 1e-30 is below the PRV FFT's round-off floor: PRV refuses, RDP still answers.
    res = run("budget", "-q", "0.01", "-s", "1.0", "--steps", "100", "--delta", "1e-30", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)  # strict JSON: no NaN
    prv = next(r for r in out["results"] if r["accountant"] == "prv")
    assert prv["epsilon"] is None and "delta" in prv["error"]
    res = run("calibrate", "--target-epsilon", "20", "--delta", "1e-30", "-q", "0.01",
              "--noise-multiplier", "1.0", "--accountant", "prv")
    assert res.returncode == 3 and "PRV" in res.stderr


@pytest.mark.job
def test_a_reader_that_stops_early_ends_the_command_quietly():
    # `dpzero budget --json | head -1`: the pipe closes before the output is written; no
    # BrokenPipeError traceback, exit 0.
    proc = subprocess.Popen([sys.executable, "-m", "dpzero", "budget", "-q", "0.01", "-s", "1.0",
                             "--steps", "1000", "--delta", "1e-5", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before a byte is read
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 0, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err
