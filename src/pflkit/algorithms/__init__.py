"""Federated algorithms, one file each, in the catalogue ``ALGORITHMS`` by config name (resolve
names, and build methods, with ``pflkit.methods``)."""

# the import order is the registration order of ALGORITHMS
# isort: off
from . import apple, ditto, fedamp, fedavg, fedavgc, fedfomo, fedprox, fedproxc, fedrep, local  # noqa: F401
from . import fedphp, partialfed, perfedavg, pfedme  # noqa: F401  (registration side effects)
from . import creff, fedacd, feddecorr, fedlc, fednh, fednova, fedntd, fedrod  # noqa: F401
from . import sosicfl  # noqa: F401
from . import fedper, lgfedavg  # noqa: F401
from . import fedavgm, fedadagrad, fedadam, fedyogi  # noqa: F401
from . import feddyn, moon  # noqa: F401
from . import apfl, fedbabu  # noqa: F401
from . import scaffold  # noqa: F401
from . import fedbn  # noqa: F401
from . import fedproto, fedgh  # noqa: F401
from . import feddbe, fedcp  # noqa: F401
from . import fedcac, fedas  # noqa: F401
from . import fedpac  # noqa: F401
from . import gpfl  # noqa: F401

# isort: on
from .base import Algorithm, ClientSummary, Init, ModelState, Payload, SentUpload, Settings, State, Trained, Upload
from .context import (
    PER_CLIENT,
    ClientContext,
    Fit,
    Metrics,
    PairedBatches,
    Sample,
    SampleBatches,
    SplitBatches,
    TrainBatches,
    TrainSettings,
)
from .registry import ALGORITHMS, Modifier, Registry, Resolved, register

__all__ = [
    "Algorithm",
    "ClientSummary",
    "Init",
    "ModelState",
    "Payload",
    "SentUpload",
    "Settings",
    "State",
    "Trained",
    "Upload",
    "PER_CLIENT",
    "ClientContext",
    "Fit",
    "Metrics",
    "PairedBatches",
    "Sample",
    "SampleBatches",
    "SplitBatches",
    "TrainBatches",
    "TrainSettings",
    "ALGORITHMS",
    "Modifier",
    "Registry",
    "Resolved",
    "register",
]
