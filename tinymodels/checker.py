"""The graders' reference: the expected answer of a problem worked out from its text alone.

Written apart from the generator (`tinymodels.tasks`) on purpose: it parses the prompt a user
would send and computes the answer with Python's own arithmetic, so a bug in the generator's
worked chains cannot agree with itself in the tests or the evaluation.
"""

from __future__ import annotations

import re
from typing import Optional

_ADD = re.compile(r"^(\d{5})\+(\d{5})$")
_SUB = re.compile(r"^(\d{5})-(\d{5})$")
_RUNNING = re.compile(r"^sum((?: [a-z]\d)+)$")
_SWAP = re.compile(r"^swap ([a-e]{5})((?: [A-Z][1-5][1-5])+)$")


def _labelled_in_order(terms: list[str]) -> bool:
    return [t[0] for t in terms] == [chr(ord("A") + i) for i in range(len(terms))]


def expected_answer(prompt: str) -> Optional[str]:
    """The graded answer for a problem text, or None when the text is not a problem of the family."""
    text = prompt.strip()
    if match := _ADD.match(text):
        return str(int(match[1]) + int(match[2])).zfill(6)
    if match := _SUB.match(text):
        difference = int(match[1]) - int(match[2])
        return str(difference).zfill(5) if difference >= 0 else None
    if match := _RUNNING.match(text):
        total, parts = 0, []
        for term in match[1].split():
            total += int(term[1])
            parts.append(f"{term[:2]}={str(total).zfill(3)}")
        return ",".join(parts)
    if (match := _SWAP.match(text)) and len(set(match[1])) == 5 and _labelled_in_order(match[2].split()):
        # where each letter sits, moved swap by swap (the generator moves the letters instead)
        where = {letter: i for i, letter in enumerate(match[1])}
        items = []
        for term in match[2].split():
            first, second = int(term[1]) - 1, int(term[2]) - 1
            if first >= second:
                return None
            for letter, i in where.items():
                where[letter] = second if i == first else first if i == second else i
            items.append(term + "=" + "".join(sorted(where, key=where.__getitem__)))
        return ",".join(items)
    return None


def graded_part(prompt: str, response: str) -> Optional[str]:
    """What a response claims as its answer: what follows the worked chain's last ';=' (sums and
    differences), else the whole response (running totals, swaps). The lm-eval task's filter takes the
    same part (bench/lm_eval/cai_builtin.yaml), so both grade alike."""
    text = response.strip().rsplit(";=", 1)[-1].strip()
    return text or None


def is_correct(prompt: str, response: str) -> bool:
    expected = expected_answer(prompt)
    return expected is not None and graded_part(prompt, response) == expected
