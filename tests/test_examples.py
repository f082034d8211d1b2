"""examples/tiny_lm.py, shortened: both attention paths train the same model to the same
losses, and the script prints its results and writes its two figures. The full run
(300 steps) and its numbers are in docs/quickstart.md."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import math
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tiny_lm.py"
FIGURES = ["tiny_lm_loss.png", "tiny_lm_attention.png"]


@pytest.fixture(scope="module")
def tiny_lm():
    spec = importlib.util.spec_from_file_location("tiny_lm", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["tiny_lm"] = module  # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules["tiny_lm"]


def test_einsum_and_sdpa_train_to_the_same_losses(tiny_lm):
    einsum, model, _ = tiny_lm.train("einsum", 5, progress=False)
    sdpa, _, _ = tiny_lm.train("sdpa", 5, progress=False)
    assert all(block.attn.impl == "einsum" for block in model.blocks)
    assert len(einsum) == len(sdpa) == 5
    assert max(abs(x - y) for x, y in zip(einsum, sdpa, strict=True)) < 1e-5
    vocab_size = model.head.out_features
    assert abs(einsum[0] - math.log(vocab_size)) < 0.5  # starts near a uniform guess
    assert einsum[-1] < einsum[0]  # and learns


def test_the_same_seed_gives_the_same_run_and_another_seed_does_not(tiny_lm):
    first, _, _ = tiny_lm.train("sdpa", 2, progress=False)
    again, _, _ = tiny_lm.train("sdpa", 2, progress=False)
    other, _, _ = tiny_lm.train("sdpa", 2, tiny_lm.Config(seed=1), progress=False)
    assert first == again
    assert first != other  # so agreement between the two paths is not a coincidence


def test_attention_of_a_block_is_causal_weights(tiny_lm):
    _, model, vocab = tiny_lm.train("einsum", 1, progress=False)
    tokens = vocab.encode(tiny_lm.PROMPT)[None]
    A = model.attention(tokens, block=1)
    L = len(tiny_lm.PROMPT)
    assert A.shape == (1, tiny_lm.Config().n_heads, L, L)  # A[n μ τ σ]
    assert (A.triu(diagonal=1) == 0).all()
    assert A.sum(-1).sub(1).abs().max() < 1e-5


def test_main_prints_results_and_saves_both_figures(tiny_lm, tmp_path):
    with contextlib.redirect_stdout(io.StringIO()) as out:
        status = tiny_lm.main(["--steps", "3", "--sample", "5", "--out", str(tmp_path),
                               "--quiet"])
    printed = out.getvalue()
    assert status == 0, printed
    for impl in ("einsum", "sdpa"):
        assert re.search(rf"^final loss, impl={impl} +\d+\.\d{{4}}", printed, flags=re.M)
    assert re.search(r"^largest \|loss\(einsum\) - loss\(sdpa\)\| over 3 steps: ", printed,
                     flags=re.M)
    assert re.search(rf"^sample: {re.escape(tiny_lm.PROMPT)}.+$", printed, flags=re.M)
    for name in FIGURES:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_main_exits_1_when_the_gap_exceeds_the_tolerance(tiny_lm, tmp_path):
    with contextlib.redirect_stdout(io.StringIO()):
        assert tiny_lm.main(["--steps", "2", "--sample", "1", "--out", str(tmp_path),
                             "--quiet", "--tolerance", "-1"]) == 1


@pytest.mark.parametrize("name", FIGURES)
def test_the_docs_show_the_figures_the_example_writes(name):
    figure = ROOT / "docs" / "img" / name
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert figure.stat().st_size < 150_000  # small enough to commit
    assert f"](img/{name})" in (ROOT / "docs" / "quickstart.md").read_text(encoding="utf-8")


def test_the_text_ships_with_the_example():
    text = (ROOT / "examples" / "sonnets.txt").read_text(encoding="utf-8")
    assert 2_000 < len(text) < 10_000 and text.isascii()
    assert "Shall I compare thee to a summer's day?" in text
