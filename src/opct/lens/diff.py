"""The difference between a pair's two rendered prompts.

A consistency pair should differ by its perturbation only: the cue, the wrapper, the started reply. `token_diff`
marks the tokens of each side that the other lacks (difflib's longest matching blocks over token ids), which the
viewer shows and `opct check` counts. `added_only` asks the question a token diff cannot answer on its own, whether
the perturbed side is the clean side with text added (every character of the clean prompt kept, in order): true of a
cue sentence, a jailbreak wrapper around the request, a system message or a reply prefix; false where the two sides
also reword, reorder or drop part of the clean prompt, so the student is trained to answer another question.
"""

from __future__ import annotations

from dataclasses import dataclass
from difflib import SequenceMatcher


@dataclass(frozen=True)
class Diff:
    """Which tokens of each side the other lacks, and the spans that differ."""
    student: list[bool]  # per student-prompt token: not matched in the teacher's prompt
    teacher: list[bool]  # per teacher-prompt token: not matched in the student's prompt
    spans: list[tuple[str, int, int, int, int]]  # difflib opcodes other than "equal": (tag, s0, s1, t0, t1)

    @property
    def identical(self) -> bool:
        return not self.spans

    @property
    def n_student(self) -> int:
        return sum(self.student)

    @property
    def n_teacher(self) -> int:
        return sum(self.teacher)

    def first(self) -> int | None:
        """The student-prompt position of the first differing token (None: identical)."""
        return self.spans[0][1] if self.spans else None


def token_diff(student_ids: list[int], teacher_ids: list[int]) -> Diff:
    """The token difference of two rendered prompts (`Diff`)."""
    sm = SequenceMatcher(None, student_ids, teacher_ids, autojunk=False)
    s, t = [False] * len(student_ids), [False] * len(teacher_ids)
    spans = []
    for tag, s0, s1, t0, t1 in sm.get_opcodes():
        if tag == "equal":
            continue
        spans.append((tag, s0, s1, t0, t1))
        s[s0:s1] = [True] * (s1 - s0)
        t[t0:t1] = [True] * (t1 - t0)
    return Diff(s, t, spans)


def added_only(student_text: str, teacher_text: str) -> tuple[bool, str]:
    """Whether the student's rendered prompt is the teacher's with text added, and, where not, the line of the
    teacher's prompt that holds the first text the student's lacks or changes (up to 120 characters), for the
    report."""
    sm = SequenceMatcher(None, student_text, teacher_text, autojunk=False)
    for tag, _s0, _s1, t0, t1 in sm.get_opcodes():
        if tag in ("replace", "insert"):  # "insert": teacher text that the student's side lacks
            while t0 < t1 and teacher_text[t0] == "\n":  # a span of whole lines: the lines, not the one before
                t0 += 1
            while t1 > t0 and teacher_text[t1 - 1] == "\n":
                t1 -= 1
            start = teacher_text.rfind("\n", 0, t0) + 1
            end = teacher_text.find("\n", t1 - 1 if t1 > t0 else t0)
            return False, teacher_text[start:len(teacher_text) if end < 0 else end][:120]
    return True, ""
