"""Per-request generation statistics and the one-line summary the CLI prints."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    rounds: int = 0  # target forward passes after prefill (verify steps)
    round_tokens: int = 0  # tokens those steps emitted (new_tokens minus the prefill's first token)
    accepted_per_position: list[int] = field(default_factory=list)  # accepted drafts at draft position k
    proposed_per_position: list[int] = field(default_factory=list)
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    host_seconds: float = 0.0
    finish_reason: str = ""

    @property
    def tau(self) -> float:
        """Mean tokens per verify step, bonus token included (1.0 for plain decoding)."""
        return self.round_tokens / self.rounds if self.rounds else 1.0

    @property
    def decode_seconds(self) -> float:
        return self.draft_seconds + self.verify_seconds + self.host_seconds

    @property
    def tokens_per_second(self) -> float:
        """New tokens over the whole request time, prefill included (what a user waits for)."""
        total = self.prefill_seconds + self.decode_seconds
        return self.new_tokens / total if total > 0 else 0.0

    def acceptance_rates(self) -> list[float]:
        return [a / p if p else 0.0 for a, p in zip(self.accepted_per_position, self.proposed_per_position)]

    def record_acceptance(self, proposed: int, accepted: int) -> None:
        """One round: `proposed` drafts were verified, the first `accepted` were taken."""
        while len(self.proposed_per_position) < proposed:
            self.proposed_per_position.append(0)
            self.accepted_per_position.append(0)
        for k in range(proposed):
            self.proposed_per_position[k] += 1
            if k < accepted:
                self.accepted_per_position[k] += 1


def summary_line(stats: list[RequestStats], wall_seconds: float) -> str:
    tokens = sum(s.new_tokens for s in stats)
    rounds = sum(s.rounds for s in stats)
    tau = sum(s.round_tokens for s in stats) / rounds if rounds else 1.0
    rate = tokens / wall_seconds if wall_seconds > 0 else 0.0
    return f"tau {tau:.2f} | {rate:.1f} tok/s | {tokens} tokens"
