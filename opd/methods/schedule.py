"""The lockstep schedule's old module name, kept for `opd.toy.audit` (which imports `plan_rows` from here) until it
imports `opd.methods.lockstep`, where the schedule lives now. Nothing else imports it."""

from opd.methods.lockstep import plan_rows  # noqa: F401
