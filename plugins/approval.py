"""Airflow's ``ApprovalOperator``, with the reviewer's answer kept on Reject too.

On Reject the stock operator skips its downstream by raising ``DownstreamTasksSkipped`` (Airflow
3), which ends the task before its return value is pushed: the task that acts on a rejection
would find no XCom saying who rejected and why (seen on the real stack). This subclass pushes
the answer under ``DECISION_KEY`` on every outcome, before the skip.
"""
from __future__ import annotations

from typing import Any

from airflow.providers.standard.operators.hitl import ApprovalOperator
from airflow.sdk.exceptions import DownstreamTasksSkipped

DECISION_KEY = "decision"
_FIELDS = ("chosen_options", "params_input", "responded_by_user")


class RecordedApprovalOperator(ApprovalOperator):
    def execute_complete(self, context: Any, event: dict[str, Any]) -> Any:
        try:
            result = super().execute_complete(context=context, event=event)
        except DownstreamTasksSkipped:
            # Filled in by HITLOperator.execute_complete before the skip.
            context["ti"].xcom_push(key=DECISION_KEY, value={k: self.hitl_summary_extra.get(k) for k in _FIELDS})
            raise
        context["ti"].xcom_push(key=DECISION_KEY, value={k: result[k] for k in _FIELDS})
        return result
