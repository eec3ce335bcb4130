"""From successive scans of the calls in a stream to the deltas not yet sent: each call's id and name
once (as soon as the name is complete), then the arguments text it gained since the last step."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..tool_call_scan import CallScan
from .base import ToolCallDelta, make_tool_call_id


@dataclass
class _Sent:
    id: str = field(default_factory=make_tool_call_id)
    named: bool = False
    arguments: int = 0   # characters of arguments already sent


class CallDeltas:
    def __init__(self) -> None:
        self._sent: list[_Sent] = []

    @property
    def count(self) -> int:
        """Calls whose name the client has been sent."""
        return sum(1 for s in self._sent if s.named)

    def update(self, index: int, scan: CallScan) -> list[ToolCallDelta]:
        """The deltas that bring call `index` (0-based, in order) up to `scan`."""
        while len(self._sent) <= index:
            self._sent.append(_Sent())
        sent = self._sent[index]
        out: list[ToolCallDelta] = []
        if not sent.named:
            if scan.name is None:
                return out   # a call without its name cannot be announced yet
            sent.named = True
            out.append(ToolCallDelta(index, id=sent.id, name=scan.name))
        new = scan.arguments[sent.arguments:]
        if new:
            sent.arguments = len(scan.arguments)
            out.append(ToolCallDelta(index, arguments=new))
        return out

    def named(self, index: int) -> bool:
        return index < len(self._sent) and self._sent[index].named
