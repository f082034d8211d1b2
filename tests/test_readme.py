"""The README tells the truth: its two commands, its example, its error message, and the
main job its first command runs (``python -m einattn``; the CLI itself is tested in
tests/test_cli.py)."""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys
from pathlib import Path

import pytest

from einattn import EinattnError, cli, derivation, functional, reference

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
CI_RUN = ROOT / ".ci" / "run"


def blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", README, flags=re.S | re.M)


def commands() -> tuple[str, str]:
    main_job, tests = (b.strip() for b in blocks("sh"))
    return main_job, tests


def test_readme_gives_exactly_two_one_line_commands():
    assert len(blocks("sh")) == 2
    for command in commands():
        assert "\n" not in command


@pytest.mark.parametrize("command", commands(), ids=["main job", "tests"])
def test_each_command_pins_the_cpu_torch_in_the_same_pip_install_as_einattn(command):
    install = re.search(r"pip install (.*?) &&", command)
    assert install, command
    assert "torch==2.13.0" in install.group(1).split()
    assert re.search(r"-e '?\.", install.group(1))
    assert command.startswith("python3 -m venv .venv && ")


def test_main_job_command_runs_einattn_and_test_command_runs_pytest():
    main_job, tests = commands()
    assert main_job.endswith(".venv/bin/python -m einattn")
    assert "'.[test]'" in tests and tests.endswith(".venv/bin/python -m pytest")


def test_ci_runs_the_readme_test_command_verbatim_and_stops_on_failure():
    script = CI_RUN.read_text(encoding="utf-8")
    lines = [line for line in script.splitlines() if line.strip()]
    assert lines[-1] == commands()[1]  # last, so its exit status is the script's
    assert "set -euo pipefail" in lines
    assert os.access(CI_RUN, os.X_OK)


def test_pyproject_never_caps_torch_and_declares_the_console_script():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    torch_spec = next(d for d in project["dependencies"] if d.startswith("torch"))
    assert re.fullmatch(r"torch>=[\d.]+", torch_spec), torch_spec
    assert project["scripts"]["einattn"] == "einattn.cli:main"


def test_readme_names_every_dependency_and_its_floor_and_no_package_index_install():
    """The dependency sentence is pyproject's list (the torch floor included), and every
    install instruction names a checkout: einattn is on no package index."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    torch_spec = next(d for d in project["dependencies"] if d.startswith("torch"))
    assert f"`{torch_spec}`" in README
    for dependency in project["dependencies"]:
        assert f"`{re.split(r'[<>=]', dependency)[0]}" in README, dependency
    assert not re.search(r"pip install (-\w+ )*einattn\b", README)


def test_import_einattn_loads_no_optional_dependency():
    """transformers (the hf extra), matplotlib and tqdm load only where they are used."""
    import subprocess

    code = ("import sys, torch; before = set(sys.modules); import einattn; "
            "print(sorted(m.split('.')[0] for m in set(sys.modules) - before))")
    added = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True).stdout  # what einattn adds to what torch loads
    assert "einattn" in added
    for optional in ("transformers", "matplotlib", "tqdm"):
        assert f"'{optional}'" not in added, added


def run_example() -> tuple[dict, str]:
    (example,) = blocks("python")
    namespace: dict = {}
    with contextlib.redirect_stdout(io.StringIO()) as out:
        exec(compile(example, "README.md", "exec"), namespace)
    return namespace, out.getvalue()


def test_readme_example_prints_what_its_comments_say():
    (example,) = blocks("python")
    promised = re.findall(r"^print\(.*\)  # (.*)$", example, flags=re.M)
    _, printed = run_example()
    assert len(promised) == 3
    assert printed.splitlines() == promised


def test_readme_error_message_is_the_one_raised():
    namespace, _ = run_example()
    call = re.search(r"`(scores\(Q=Q, K=torch\.randn\([^`]*\)\))` raises", README).group(1)
    (shown,) = blocks("text")
    with pytest.raises(EinattnError) as error:
        eval(call, namespace)
    assert f"EinattnError: {error.value}" == shown.rstrip("\n")


def run_main(argv: list[str]) -> tuple[int, str]:
    with contextlib.redirect_stdout(io.StringIO()) as out:
        code = cli.main(argv)
    return code, out.getvalue()


def test_main_job_description_names_what_the_main_job_prints():
    main_job = re.search(r"Run einattn's main job(.*?)```sh", README, flags=re.S).group(1)
    for promised in ("equation", "einsum", "shapes", "FLOPs", "largest intermediate",
                     "derivation", "reference", "--help", "docs/cli.md"):
        assert promised in main_job, promised


def test_main_job_traces_every_stage_and_passes_without_rich(monkeypatch):
    monkeypatch.setitem(sys.modules, "rich", None)  # rich is no dependency: import fails
    code, out = run_main([])
    assert code == 0
    for name in ["PROJECT", "SCORES", "SOFTMAX", "VALUES", "HEADS"]:
        assert re.search(rf"^\(\d\) {name} +{re.escape(str(getattr(functional, name)))} ", out,
                         flags=re.M), name
    assert re.search(r"^\(5\) HEADS +Z \(2, 4, 5, 4\)  W_O \(4, 4, 16\)  Y \(2, 5, 16\) ", out,
                     flags=re.M)
    assert re.search(r"^\(1\) PROJECT +X \(2, 5, 16\)  W \(48, 16\) ", out, flags=re.M)
    assert re.search(r"^PASS +float .* whole layer = reshape form$", out, flags=re.M)
    assert out.count("PASS ") == len(derivation.steps())


def letter_mapped(equation: str, mapping: dict[str, str]) -> str:
    """The einsum an equation should become under ``mapping``, worked out independently."""
    terms = ["".join(mapping.get(i, i) for i in re.sub(r"[()]", " ", t).split())
             for t in re.findall(r"\[([^\]]*)\]", equation)]
    return f"{','.join(terms[1:])}->{terms[0]}"


def test_main_job_spells_out_the_letter_mapping_of_every_einsum():
    _, out = run_main([])
    equations = {name: str(getattr(functional, name)) for name in cli.EQUATIONS}
    stages = re.findall(r"^\(\d\) (\w+) +(.*?)  +([a-zA-Z,]+->[a-zA-Z]+) +((?:\S=\w ?)+)$", out,
                        flags=re.M)
    assert len(stages) == 4  # every stage but the softmax is a contraction
    for name, equation, einsum, letters in stages:
        assert equation == equations[name]
        mapping = dict(pair.split("=") for pair in letters.split())
        assert letter_mapped(equation, mapping) == einsum


def test_main_job_fails_with_a_nonzero_exit_when_the_reference_disagrees(monkeypatch):
    honest = reference.multi_head_attention
    monkeypatch.setattr(reference, "multi_head_attention",
                        lambda *args, **kwargs: honest(*args, **kwargs) * (1 + 1e-9))
    code, out = run_main([])
    assert code == 1
    assert re.search(r"^FAIL +float .* whole layer = reshape form$", out, flags=re.M)


def test_main_job_rejects_an_unknown_option_with_status_2(capsys):
    assert cli.main(["--no-such-option"]) == 2
    assert capsys.readouterr().err == "einattn: error: unrecognized arguments: --no-such-option\n"
