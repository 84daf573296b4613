"""Where each pipeline stage's tensor-parallel ranks are: stage s's rank t is global
rank ((s + 1) % P) * T + t, so the engine's own process (global rank 0, which hosts
the rendezvous) is the last stage's tensor-parallel rank 0, the one that samples."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StageRanks:
    tp: int  # --tensor-parallel-size: ranks per stage
    pp: int  # --pipeline-parallel-size: stages

    @property
    def world(self) -> int:
        return self.tp * self.pp

    def rank(self, stage: int, tp_rank: int) -> int:
        return ((stage + 1) % self.pp) * self.tp + tp_rank

    def place(self, rank: int) -> tuple[int, int]:
        """(stage, tensor-parallel rank) of a global rank."""
        return (rank // self.tp - 1) % self.pp, rank % self.tp

    def stages(self) -> list[list[int]]:
        """Each stage's global ranks, in tensor-parallel order."""
        return [[self.rank(s, t) for t in range(self.tp)] for s in range(self.pp)]

    def previous(self, rank: int) -> int:
        """Where a rank's steps come from: the engine for the first stage."""
        stage, t = self.place(rank)
        return 0 if stage == 0 else self.rank(stage - 1, t)

    def following(self, rank: int) -> int | None:
        """Where a rank hands its steps on (None: the last stage's)."""
        stage, t = self.place(rank)
        return None if stage == self.pp - 1 else self.rank(stage + 1, t)
