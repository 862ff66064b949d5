"""Deepscaler-style 0/1 math reward for miles' ``--custom-rm-path kimi_rl_glue.miles.reward.math_rm``.

Rule (as miles' ``--rm-type deepscaler``, ``radixark/miles:miles/rollout/rm_hub/deepscaler.py``; our
own code): grade only the text after the end of thinking (the last ``</think>``, or ``###Response``;
no marker means reward 0 unless ``require_think=False``), take the **last** ``\\boxed{...}`` there
(balanced braces; ``\\fbox`` and ``\\boxed 5`` too), and compare it with the label after string
normalisation, then numerically/symbolically. A label that itself holds a ``\\boxed{}`` is unwrapped.

The symbolic check parses a whitelisted subset of LaTeX (digits, ``+ - * / ^ ( ) . ,``, ``\\frac``,
``\\sqrt``, ``\\pi``, ``\\cdot``, ``\\times``, single-letter variables) with sympy; anything else is
compared as text only, so model output never reaches ``eval`` unchecked, and exponents are bounded so a
crafted answer cannot stall the reward worker.
"""

from __future__ import annotations

import math
import re

__all__ = [
    "THINK_END_MARKERS",
    "extract_boxed",
    "solution_text",
    "normalize_answer",
    "answers_equivalent",
    "math_reward",
    "math_rm",
]

THINK_END_MARKERS = ("</think>", "###Response")
_MAX_SYMBOLIC_LEN = 120


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{..}`` / ``\\fbox{..}`` (or ``\\boxed x``) in ``text``; None if there is none."""
    for m in reversed(list(re.finditer(r"\\(boxed|fbox)", text))):
        j = m.end()
        if j < len(text) and text[j] == "{":
            depth = 0
            for k in range(j, len(text)):
                if text[k] == "{":
                    depth += 1
                elif text[k] == "}":
                    depth -= 1
                    if depth == 0:
                        return text[j + 1 : k]
            continue  # unbalanced: try an earlier box
        if m.group(1) == "boxed" and text.startswith(" ", j):
            rest = text[j:].split("$")[0].split()
            if rest:
                return rest[0]
    return None


def solution_text(
    response: str, require_think: bool = True, markers: tuple[str, ...] = THINK_END_MARKERS
) -> str | None:
    """The part of ``response`` after the last end-of-thinking marker; None when required and absent."""
    best = -1
    cut = None
    for m in markers:
        k = response.rfind(m)
        if k > best:
            best, cut = k, k + len(m)
    if cut is None:
        return None if require_think else response
    return response[cut:]


def _strip_text_cmd(s: str) -> str:
    return re.sub(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}", r"\1", s)


def _fix_fracs(s: str) -> str:
    # \frac12 -> \frac{1}{2}, \frac1{x} -> \frac{1}{x}
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac(\d)\{", r"\\frac{\1}{", s)
    return re.sub(r"\\sqrt(\d+)", r"\\sqrt{\1}", s)


def normalize_answer(ans: str) -> str:
    """Canonical string form of a math answer (units-free spacing, LaTeX spelling variants, ``x=``)."""
    s = str(ans).strip()
    s = _strip_text_cmd(s)
    for a, b in (
        ("\\dfrac", "\\frac"),
        ("\\tfrac", "\\frac"),
        ("\\left", ""),
        ("\\right", ""),
        ("\\!", ""),
        ("\\,", ""),
        ("\\;", ""),
        ("\\:", ""),
        ("\\displaystyle", ""),
        ("^{\\circ}", ""),
        ("^\\circ", ""),
        ("\\%", ""),
        ("%", ""),
        ("$", ""),
        ("\\$", ""),
        ("\n", ""),
        ("\\infty", "oo"),
        ("\\le", "<="),
        ("\\ge", ">="),
    ):
        s = s.replace(a, b)
    s = s.replace(" ", "")
    s = s.rstrip(".")
    if re.fullmatch(r"[a-zA-Z]=.+", s):
        s = s[2:]
    if re.fullmatch(r"\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    s = _fix_fracs(s)
    if s.startswith("."):
        s = "0" + s
    if re.fullmatch(r"-?\d+\.\d*?0+", s):  # 2.50 -> 2.5, 3.0 -> 3
        s = s.rstrip("0").rstrip(".")
    return s


def _latex_to_expr(s: str) -> str | None:
    """A whitelisted LaTeX answer as a sympy-parsable string, or None when it is outside the subset."""
    if len(s) > _MAX_SYMBOLIC_LEN:
        return None
    out = s
    for _ in range(8):  # innermost-first expansion of \frac / \sqrt with simple brace arguments
        new = re.sub(r"\\frac\{([^{}]*)\}\{([^{}]*)\}", r"((\1)/(\2))", out)
        new = re.sub(r"\\sqrt\[([^\[\]{}]*)\]\{([^{}]*)\}", r"((\2)**(1/(\1)))", new)
        new = re.sub(r"\\sqrt\{([^{}]*)\}", r"sqrt(\1)", new)
        if new == out:
            break
        out = new
    out = out.replace("\\pi", "pi").replace("\\cdot", "*").replace("\\times", "*").replace("{", "(").replace("}", ")")
    out = out.replace("^", "**")
    if "\\" in out or not re.fullmatch(r"[0-9a-zA-Z+\-*/().,\s]*", out):
        return None
    words = set(re.findall(r"[a-zA-Z]+", out))
    if any(len(w) > 1 and w not in ("sqrt", "pi", "oo") for w in words):
        return None
    # Bound exponents: no power towers, no exponent with more than 3 digits.
    if out.count("**") > 2 or re.search(r"\*\*\(?\s*\d{4,}", out):
        return None
    return out


def _sympy_equal(a: str, b: str) -> bool:
    ea, eb = _latex_to_expr(a), _latex_to_expr(b)
    if ea is None or eb is None:
        return False
    try:
        import sympy
        from sympy.parsing.sympy_parser import implicit_multiplication_application, parse_expr, standard_transformations
    except ImportError:
        return False
    tr = standard_transformations + (implicit_multiplication_application,)
    names = {"sqrt": sympy.sqrt, "pi": sympy.pi, "oo": sympy.oo}
    try:
        xa = parse_expr(ea, local_dict=dict(names), transformations=tr, evaluate=True)
        xb = parse_expr(eb, local_dict=dict(names), transformations=tr, evaluate=True)
        if isinstance(xa, tuple) or isinstance(xb, tuple):
            xa, xb = (xa if isinstance(xa, tuple) else (xa,)), (xb if isinstance(xb, tuple) else (xb,))
            return len(xa) == len(xb) and all(_expr_equal(sympy, u, v) for u, v in zip(xa, xb))
        return _expr_equal(sympy, xa, xb)
    except Exception:  # noqa: BLE001 - sympy raises many types on unparsable answers: not equal
        return False


def _expr_equal(sympy, xa, xb) -> bool:
    if xa.is_number and xb.is_number:
        fa, fb = complex(xa.evalf()), complex(xb.evalf())
        return abs(fa - fb) <= 1e-6 * max(1.0, abs(fb))
    return sympy.simplify(xa - xb) == 0


def answers_equivalent(answer: str, label: str) -> bool:
    """True when ``answer`` and ``label`` normalise to the same string or to equal values/expressions."""
    a, b = normalize_answer(answer), normalize_answer(label)
    if not a or not b:
        return False
    if a == b:
        return True
    try:
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-9)
    except ValueError:
        pass
    return _sympy_equal(a, b)


def math_reward(response: str, label, require_think: bool = True) -> float:
    """0/1 reward of a ``response`` against a ``label`` (str/int/float; a boxed label is unwrapped)."""
    if label is None or str(label).strip() == "":
        return 0.0
    text = solution_text(response or "", require_think)
    if text is None:
        return 0.0
    answer = extract_boxed(text)
    if answer is None:
        return 0.0
    truth = str(label)
    if "\\boxed" in truth or "\\fbox" in truth:
        truth = extract_boxed(truth) or truth
    return 1.0 if answers_equivalent(answer, truth) else 0.0


async def math_rm(args, sample, **kwargs):
    """miles ``--custom-rm-path`` entry: ``sample.response`` vs ``sample.label``.

    Accepts one ``Sample`` (returns a float) or, under ``--group-rm``, a list (returns a list).
    ``args.kimi_rm_require_think`` (default True) keeps deepscaler's rule that a response without an
    end-of-thinking marker scores 0.
    """
    require = bool(getattr(args, "kimi_rm_require_think", True))
    if isinstance(sample, (list, tuple)):
        return [math_reward(s.response, s.label, require) for s in sample]
    return math_reward(sample.response, sample.label, require)
