"""The ``structattn`` command line.

    structattn cost --levels 3 --stride 2 [--seq-len 4096] [--json]

Each subcommand is a dataclass whose fields are its flags (parsed by ``tyro``); ``--help`` on any
subcommand lists them with their defaults.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import tyro

__all__ = ["Cost", "main"]


@dataclass
class Cost:
    """Score-FLOP ratio of HKT against standard attention: the paper's count and what runs."""

    levels: int = 3  # number of resolution levels L
    stride: int = 2  # length ratio s between levels
    seq_len: int | None = None  # exact T_l = ceil(T_{l-1}/s) at this T (default: large-T limit)
    head_dim: int = 64  # head dim d, only for the absolute FLOP count
    json: bool = False  # print JSON instead of a table

    def run(self) -> None:
        from structattn.hkt import hkt_cost

        cost = hkt_cost(self.levels, self.stride, seq_len=self.seq_len, head_dim=self.head_dim)
        if self.json:
            print(json.dumps(asdict(cost), indent=2))
            return
        at = f"T = {self.seq_len}" if self.seq_len else "large-T limit"
        rows = [
            ("paper: score FLOPs, sum_l (T_l/T)^2", cost.paper_score_ratio),
            ("paper: bound s^2/(s^2-1) for any L", cost.paper_bound),
            ("fast path (SDPA): score FLOPs executed", cost.fast_score_ratio),
            ("fast path (SDPA): scores + A.V executed", cost.fast_total_ratio),
            ("exact fused kernel floor: scores + A.V", cost.fused_total_ratio),
        ]
        print(f"HKT cost vs standard attention, L = {self.levels}, s = {self.stride}, {at}")
        print("| quantity | ratio to MHA |\n|---|---|")
        for name, value in rows:
            print(f"| {name} | {value:.4f} |")
        if cost.mha_flops is not None:
            print(f"standard attention, one head, d = {self.head_dim}: {cost.mha_flops:.3e} FLOPs")


COMMANDS = {"cost": Cost}


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``structattn`` console script."""
    command = tyro.extras.subcommand_cli_from_dict(COMMANDS, args=argv, prog="structattn")
    try:
        command.run()
    except ValueError as err:  # bad options: one line naming the problem, no traceback
        raise SystemExit(f"structattn: error: {err}") from None


if __name__ == "__main__":
    main()
