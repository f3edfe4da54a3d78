"""Deployment doctor: ``dspark check`` (checks.py) and the checks ``generate``/``serve``/``LLM`` run at load
(gate.py). Depends on dspark.checkpoint and dspark.models; neither imports it."""

from dspark.doctor.checks import (
    CHECKS,
    LOAD_CHECKS,
    METRICS,
    STEPS,
    CheckProblem,
    CheckReport,
    format_report,
    report_json,
    run_checks,
)

__all__ = [
    "CHECKS",
    "LOAD_CHECKS",
    "METRICS",
    "STEPS",
    "CheckProblem",
    "CheckReport",
    "format_report",
    "report_json",
    "run_checks",
]
