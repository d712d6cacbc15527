"""Judges: turn (prompt, response) pairs into verdicts through one interface (`opct.judges.base.Judge`).

  refusal.RefusalJudge          regex on the start of the response: refused or not (no model, no network)
  strongreject.StrongRejectJudge the StrongREJECT rubric (official prompt, parser and score formula) through any
                                OpenAI-compatible endpoint (`endpoint.chat_completion`) or a local transformers model
  endpoint                      the OpenAI-compatible chat client every model judge sends through
(the safety axis' own judges, keyword / SAGE-style rubric / local model, are in opct.axes.safety.judges)
"""

from opct.judges.base import Judge, Verdict, agreement, summarise

__all__ = ["Judge", "Verdict", "agreement", "summarise"]
