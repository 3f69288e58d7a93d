"""Where a run stands between steps: its data position (which is its step), the tokens it has trained on, and
what a resume or an `init_from` carried over. One immutable value: a step, a resume or a restore returns a new
one, so nothing writes into the trainer from outside."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ferry.data import DataCursor


@dataclass(frozen=True)
class TrainState:
    cursor: DataCursor
    tokens_seen: int = 0
    carried: dict[str, str] = field(default_factory=dict)  # part of the state -> how it came over (run.json)

    @property
    def step(self) -> int:
        return self.cursor.step

    def advanced(self, cursor: DataCursor, tokens: int) -> TrainState:
        """The state after a step that moved the data to `cursor` and trained on `tokens` tokens."""
        return replace(self, cursor=cursor, tokens_seen=self.tokens_seen + tokens)

    def with_carried(self, carried: dict[str, str]) -> TrainState:
        return replace(self, carried=carried)

    def state_dict(self) -> dict:
        """The entries of a checkpoint's train state that this object owns (names as checkpoints have had them)."""
        return {"data_cursor": self.cursor.to_dict(), "tokens_seen": self.tokens_seen}

    def load_state_dict(self, state: dict, tokens_per_step: int) -> TrainState:
        """The state a checkpoint's train state describes; this one is left as it was. A checkpoint written
        before tokens were counted is taken to have trained `tokens_per_step` tokens a step."""
        cursor = DataCursor.from_dict(state["data_cursor"])
        tokens = int(state.get("tokens_seen", cursor.step * tokens_per_step))
        return replace(self, cursor=cursor, tokens_seen=tokens)
