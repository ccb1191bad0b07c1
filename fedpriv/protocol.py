"""Names shared by the client and the server: message types and record keys."""

MSG_HELLO = "query.hello"  # node -> server: which partition it is
MSG_STEP = "train.step"  # a private step: nodes return clipped sums
MSG_FINAL = "evaluate.final"  # the final fit and metrics

CONFIG = "config"
ARRAYS = "arrays"  # broadcast arrays (server -> node); per-part sums (node -> server)
METRICS = "metrics"

KEY_STEP = "step"  # the Step, as JSON (fedpriv.algorithms.base.Step.to_json)
KEY_NUM_USERS = "num-users"
KEY_NUM_CLIPPED = "num-clipped"
KEY_PARTITION = "partition-id"
KEY_NUM_PARTITIONS = "num-partitions"
KEY_DATA_FILE = "data-file"  # node config: this node's own copy of a data file
KEY_DATA_PART = "data-part"
METRIC_PREFIX = "m."
KEY_COMPUTE_S = "compute-s"  # the node's seconds in node_step (the profile in the operator report)
KEY_DECODE_S = "decode-s"  # the node's seconds reading the step and its arrays

# secure aggregation (aggregation = "secure"): one message type per stage of a round
MSG_SECAGG = {"setup": "train.secagg_setup", "share-keys": "query.secagg_keys",
              "collect": "query.secagg_collect", "unmask": "query.secagg_unmask"}
SECAGG_STATE = "secagg"  # a node's context.state: its secure-aggregation state
SECAGG_STATE_ARRAYS = "secagg-arrays"
