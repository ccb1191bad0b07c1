"""Names shared by the client and the server: message types and record keys."""

MSG_HELLO = "query.hello"  # node -> server: which partition it is
MSG_STEP = "train.step"  # a private step: nodes return clipped sums
MSG_FINAL = "evaluate.final"  # the final fit and metrics

CONFIG = "config"
ARRAYS = "arrays"
METRICS = "metrics"

KEY_STEP_KIND = "step-kind"
KEY_STEP_INDEX = "step-index"
KEY_STEP_RELEASE = "step-release"
KEY_CLIP_NORM = "clip-norm"
KEY_TOTAL = "total"
KEY_NUM_USERS = "num-users"
KEY_NUM_CLIPPED = "num-clipped"
KEY_PARTITION = "partition-id"
KEY_NUM_PARTITIONS = "num-partitions"
METRIC_PREFIX = "m."
