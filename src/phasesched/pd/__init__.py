"""Disaggregated prefill and decode for real: the protocol, router and workers (no torch).

The KV pages move through a :class:`~phasesched.pd.worker.PageTransport`;
``phasesched_torch`` provides one over ``torch.distributed`` and the process launcher
(``python -m phasesched_torch.pd``). See :doc:`/explanation/disaggregation`.
"""

from __future__ import annotations

from phasesched.pd.protocol import KeyValueStore as KeyValueStore
from phasesched.pd.protocol import Mailbox as Mailbox
from phasesched.pd.protocol import Manifest as Manifest
from phasesched.pd.router import RequestOutcome as RequestOutcome
from phasesched.pd.router import Router as Router
from phasesched.pd.router import WorkerStatus as WorkerStatus
from phasesched.pd.routing import WorkerLoad as WorkerLoad
from phasesched.pd.routing import pick_worker as pick_worker
from phasesched.pd.routing import pick_worker_by as pick_worker_by
from phasesched.pd.worker import DecodeWorker as DecodeWorker
from phasesched.pd.worker import Faults as Faults
from phasesched.pd.worker import PageTransport as PageTransport
from phasesched.pd.worker import PrefillWorker as PrefillWorker
from phasesched.pd.worker import TransferError as TransferError
from phasesched.pd.worker import WorkerReport as WorkerReport

__all__ = [
    "DecodeWorker",
    "Faults",
    "KeyValueStore",
    "Mailbox",
    "Manifest",
    "PageTransport",
    "PrefillWorker",
    "RequestOutcome",
    "Router",
    "TransferError",
    "WorkerLoad",
    "WorkerReport",
    "WorkerStatus",
    "pick_worker",
    "pick_worker_by",
]
