"""Checks run on several gloo processes on the CPU, for the tests of einattn.parallel.

A test module keeps a dict ``CHECKS`` of name -> check(mesh); :func:`run_checks` starts the
processes once, each runs every check in order and records, per check, what it returned or
its traceback, and the test module turns each check into a pytest test with
:func:`assert_on_every_rank`. Spawning the processes costs more than the checks together.
"""

from __future__ import annotations

import ast
import datetime
import importlib
import os
import pickle
import socket
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world: int, port: int, out: str, module: str, only) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            init_method=f"tcp://127.0.0.1:{port}",
                            timeout=datetime.timedelta(seconds=60))  # a hung check fails
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world,))
    results = {}
    for name, fn in importlib.import_module(module).CHECKS.items():
        if only is not None and name not in only:
            continue
        start = time.perf_counter()
        try:
            results[name] = ("ok", fn(mesh))
        except pytest.skip.Exception as e:
            results[name] = ("skipped", str(e))
        except Exception:
            results[name] = ("failed", traceback.format_exc())
        results[name] += (time.perf_counter() - start,)
    with open(Path(out) / f"rank{rank}.pkl", "wb") as f:
        pickle.dump(results, f)
    dist.barrier()  # no rank tears the group down while another still uses it
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_checks(module: str, world: int, out: Path, *, only=None) -> list[dict]:
    """Every check's (status, detail, seconds) of ``module``'s CHECKS (those named in
    ``only``, where given) on each of ``world`` ranks."""
    context = mp.start_processes(_worker, args=(world, _free_port(), str(out), module, only),
                                 nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + 600
    for p in context.processes:  # each to its end: one that dies does not stop the others
        p.join(max(0.0, deadline - time.monotonic()))
    for p in context.processes:
        if p.is_alive():
            p.kill()
    files = [out / f"rank{k}.pkl" for k in range(world)]
    if not all(f.exists() for f in files):  # a rank died (or hung) before its results
        codes = [p.exitcode for p in context.processes]
        pytest.fail(f"the {world} gloo processes ended with exit codes {codes} before every "
                    f"rank wrote its results (gloo torn down while in use, or a hang)")
    results = []
    for f in files:  # a rank that wrote them and then died at teardown still counts
        with open(f, "rb") as handle:
            results.append(pickle.load(handle))
    return results


# The multi-process checks that repeat others' ground on more ranks run with EINATTN_SLOW=1
# (as the suite's other slow cases do): the default suite stays within its time budget.
SLOW = bool(os.environ.get("EINATTN_SLOW"))


def rank_tests(module: str, worlds: list[int], checks: dict, *, slow=lambda world: ()) -> tuple:
    """For a test module to take as its own: the fixture ``ranks`` (every check's results on
    each rank, from one set of processes per number of ranks in ``worlds``) and
    ``test_on_every_rank``, one test per check. ``slow(world)``: the names of the checks
    that run on ``world`` ranks only with EINATTN_SLOW=1 (skipped, with the reason,
    otherwise)."""
    @pytest.fixture(scope="module", params=worlds, ids=[f"{w} ranks" for w in worlds])
    def ranks(request, tmp_path_factory) -> list[dict]:
        skipped = () if SLOW else set(slow(request.param))
        only = None if not skipped else [name for name in checks if name not in skipped]
        return run_checks(module, request.param, tmp_path_factory.mktemp("ranks"), only=only)

    @pytest.mark.parametrize("name", list(checks))
    def test_on_every_rank(ranks, name):
        assert_on_every_rank(ranks, name)
    return ranks, test_on_every_rank


def assert_on_every_rank(ranks: list[dict], name: str) -> None:
    """Check ``name`` passed on every rank (or skip where it skipped, or was left out as
    slow); print what it measured."""
    if name not in ranks[0]:
        pytest.skip(f"on {len(ranks)} ranks with EINATTN_SLOW=1 only (a slow case)")
    for k, results in enumerate(ranks):
        status, detail, seconds = results[name]
        if status == "skipped":
            pytest.skip(detail)
        assert status == "ok", f"rank {k} of {len(ranks)}:\n{detail}"
        print(f"rank {k} {name} ({seconds:.2f} s): {detail}")


def scaled_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``max |actual − expected| / max(1, max |expected|)``, after checking shapes."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    scale = max(1.0, expected.abs().max().item())
    return (actual - expected).abs().max().item() / scale


def raise_sites(path: str) -> set[tuple[str, int]]:
    """``(file name, line)`` of each ``raise`` in the module at ``path``."""
    text = Path(path).read_text(encoding="utf-8")
    return {(Path(path).name, node.lineno) for node in ast.walk(ast.parse(text))
            if isinstance(node, ast.Raise)}


def unreached_raise_sites(ranks: list[dict], *paths: str) -> set[tuple[str, int]]:
    """The raise sites of the modules at ``paths`` that no rank's ``errors_with_a_mesh``
    check reached (it returns the sites it reached, as ``{"raise lines": [...]}``)."""
    reached = set()
    for results in ranks:
        status, detail, _ = results["errors_with_a_mesh"]
        assert status == "ok", detail
        reached |= {tuple(site) for site in detail["raise lines"]}
    return set().union(*map(raise_sites, paths)) - reached


def raised_in(call, match: str, paths) -> set[tuple[str, int]]:
    """Run ``call``, which must raise EinattnError matching ``match``; the ``(file name,
    line)`` of its traceback's frames in the modules at ``paths``."""
    from einattn import EinattnError

    with pytest.raises(EinattnError, match=match) as info:
        call()
    files = {Path(p).resolve() for p in paths}
    return {(Path(f.filename).name, f.lineno) for f in traceback.extract_tb(info.tb)
            if Path(f.filename).resolve() in files}
