"""The compiled forward pass from AOTInductor packages (graph_packages.py): the
three graphs of compiled_model.py (decode of one request, decode of several, the
hidden states of any other step), each loaded from its package, or built (by the
build process, engine/core/package_build_process.py, or here where none is given) and then loaded.

The serving process never exports a graph itself when it has a build process:
torch.export patches torch and the model process-wide, which eager steps running
beside it would trip over."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from kvserve.engine.kernels.attention.cpu_paged import PagedDecode
from kvserve.engine.runner.graph_packages import GraphPackages, PackagedGraph, step_inputs
from kvserve.engine.runner.package_constants import IN_LIBRARY

log = logging.getLogger("kvserve.compile")

# Seconds between loading one built graph and the next in a serving process.
HANDOVER_GAP_S = 1.0
# (kind, warm-up tokens, decode, Inductor's options to try in turn): a graph's plan.
Plan = list[tuple[str, int, bool, list[dict]]]


class PackagedForward:
    def __init__(self, store: GraphPackages, build_elsewhere: Callable[[], None] | None):
        self.store, self.build_elsewhere = store, build_elsewhere
        self.graphs: dict[str, PackagedGraph] = {}  # kind -> its loaded package

    def decode_logits(self, ids: torch.Tensor, positions: torch.Tensor,
                      paged: PagedDecode) -> torch.Tensor:
        kind = "decode_one" if len(ids) == 1 else "decode_many"
        return self.graphs[kind](*step_inputs(kind, ids, positions, paged))

    def hidden(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.graphs["hidden"](ids, positions)

    @staticmethod
    def plan(frozen: bool, batch_one: list[dict]) -> Plan:
        """Each graph's plan. Inductor's options are Dynamo's graphs' (freezing where
        torch does the GEMMs; `batch_one`'s in turn at batch 1, compiled_model.py's
        GEMV template and then oneDNN allowed where it leaves a GEMM without a
        kernel), less those only Dynamo's path knows (its guards, its wrapper: a
        package's is C++)."""
        common = {"freezing": frozen, "size_asserts": False, "alignment_asserts": False,
                  IN_LIBRARY: frozen}
        return [("decode_one", 1, True, [{**common, **o} for o in batch_one]),
                ("decode_many", 16, True, [common]), ("hidden", 256, False, [common])]

    def on_disk(self, plan: Plan) -> bool:
        """Whether every graph's package was found and loaded."""
        try:
            return self.load(plan)
        except Exception as exc:  # noqa: BLE001 - tried again by build_all, said there
            log.warning("loading the forward pass's packages failed: %s", exc)
            return False

    def load(self, plan: Plan, gap: float = 0.0) -> bool:
        """Every graph's package found under its key loaded, `gap` seconds apart;
        whether all were."""
        loaded = 0
        for kind, _, _, choices in plan:
            for options in choices:
                if kind in self.graphs:
                    break
                time.sleep(gap if loaded else 0.0)
                if graph := self.store.load(kind, options):
                    self.graphs[kind], loaded = graph, loaded + 1
        return len(self.graphs) == len(plan)

    def build_all(self, plan: Plan, run_step: Callable) -> None:
        """Each graph of the plan from its package: loaded; else built by the build
        process and loaded; else (none given) exported and compiled here over its
        warm-up step. Then the warm-up steps through every one (run_step: as
        CompiledModel.build takes it)."""
        if self.build_elsewhere is not None and not self.load(plan):
            marker = self.store.failure_marker()
            if marker.exists():
                raise RuntimeError(f"an earlier build of these graphs failed ({marker}: "
                                   f"{marker.read_text()[-500:]}); remove it to try again")
            log.info("building the forward pass's graphs ahead of time in a process "
                     "of their own...")
            try:
                self.build_elsewhere()
            except Exception as exc:
                marker.parent.mkdir(parents=True, exist_ok=True)
                marker.write_text(str(exc))
                raise
            # Handed to a serving process: each load holds the GIL ~0.2 s, so a
            # request's steps wait out one of them at most.
            if not self.load(plan, gap=HANDOVER_GAP_S):
                raise RuntimeError("the build process left no package under this "
                                   "process's keys")
        with torch.inference_mode():
            for i, (kind, tokens, decode, choices) in enumerate(plan, 1):
                log.info("the forward pass's graphs (%d/%d: %s)...", i, len(plan), kind)
                for n, options in enumerate(choices, 1):
                    try:
                        run_step(self._step(kind, options), tokens, decode, False)
                        break
                    except Exception as exc:  # noqa: BLE001 - one kind is retried
                        if n == len(choices) or "NoValidChoicesError" not in str(exc):
                            raise
                        log.info("batch-1 decode: Inductor's GEMV template does not "
                                 "cover every GEMM of this model; oneDNN allowed where "
                                 "it does not")

    def _step(self, kind: str, options: dict) -> Callable:
        """A warm-up step's function: the graph's package (loaded, or built over
        this step's inputs), then the step through it."""
        model = self.store.model

        def forward(ids, positions, *paged):
            if kind == "hidden":
                return model(ids, positions)
            return model.compute_logits(model(ids, positions, paged=PagedDecode(*paged)))

        def step(ids, positions, paged=None):
            inputs = step_inputs(kind, ids, positions, paged)
            if kind not in self.graphs:
                self.graphs[kind] = self.store.load_or_build(kind, forward, inputs, options)
            return self.graphs[kind](*inputs)

        return step
