"""The one base class of ``strata-budget``'s input errors (bad card, options, or expert profile).

An input error is the user's to fix, never a pack defect: ``strata-budget check`` prints it as one
``error: ...`` line and exits 2 (with ``--json``: one object, ``verdict`` ``"error"``, whose
``errors`` list holds :meth:`BudgetInputError.as_error`). ``tensor``, ``found`` and ``required``
are the same fields as an audit failure's, filled where they apply (the tensor, file row or option
concerned; what was found; what is required).
"""

from __future__ import annotations


class BudgetInputError(ValueError):
    """An input that cannot be planned for; the message is complete on its own (one line)."""

    def __init__(self, message: str, *, tensor: str = "", found: str = "", required: str = ""):
        super().__init__(message)
        self.tensor, self.found, self.required = tensor, found, required

    def as_error(self) -> dict[str, str]:
        """``{tensor, found, required, message}``: the shape of every entry of ``--json``'s ``errors``."""
        return {"tensor": self.tensor, "found": self.found, "required": self.required, "message": str(self)}


class PlanInputError(BudgetInputError):
    """Options or a profile that cannot be planned (bad profile rows, impossible option values, a
    KV cache type the model's rows cannot be stored in); ``tensor``/``found``/``required`` filled
    where they apply."""


__all__ = ["BudgetInputError", "PlanInputError"]
