"""One output split into reasoning and content as its text arrives, for streams and whole
responses alike (a whole response is one piece)."""

from __future__ import annotations

from tpserve.server.http.reasoning.parser import ReasoningPlan


def _held_tail(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (and is shorter):
    those characters may yet become the tag."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


class ReasoningSplit:
    """Feeds an output's text piece by piece (``feed``) and says which new text is
    reasoning and which is content; the tags themselves are in neither.

    Invariants: ``pos`` characters of ``text`` are decided; the phase is ``start`` (the
    output might still begin with the start tag), ``reasoning`` or ``content``. Text that
    could still be part of a tag is held until it is not (or until ``finish``). The
    concatenated pieces equal what one ``feed`` of the whole text and ``finish`` give."""

    def __init__(self, plan: ReasoningPlan):
        self.plan = plan
        self.text = ""
        self.pos = 0
        self.phase = "start"

    def feed(self, piece: str) -> tuple[str, str]:
        """(reasoning, content) that ``piece`` decides."""
        self.text += piece
        return self._advance(final=False)

    def finish(self) -> tuple[str, str]:
        """(reasoning, content) still held when the output ends."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> tuple[str, str]:
        start, end = self.plan.parser.start, self.plan.parser.end
        reasoning = content = ""
        if self.phase == "start":
            if self.text.startswith(start):
                self.pos, self.phase = len(start), "reasoning"
            elif start.startswith(self.text) and not final:
                return "", ""  # maybe the start tag: wait
            else:
                self.phase = "reasoning" if self.plan.opens else "content"
        if self.phase == "reasoning":
            at = self.text.find(end, self.pos)
            if at >= 0:
                reasoning = self.text[self.pos:at]
                self.pos, self.phase = at + len(end), "content"
            else:
                upto = len(self.text) - (0 if final else _held_tail(self.text, end))
                reasoning = self.text[self.pos:upto]
                self.pos = max(self.pos, upto)
        if self.phase == "content":
            content = self.text[self.pos:]
            self.pos = len(self.text)
        return reasoning, content

    @staticmethod
    def whole(plan: ReasoningPlan, text: str) -> tuple[str | None, str | None]:
        """A whole output's (reasoning, content), each None when empty."""
        split = ReasoningSplit(plan)
        r1, c1 = split.feed(text)
        r2, c2 = split.finish()
        return (r1 + r2) or None, (c1 + c2) or None
