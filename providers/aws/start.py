"""What an AWS start script adds: a node of a multi-node launch finds its rank from its
``ami-launch-index`` (``Aws.rank_step``, used by ``providers.bootstrap.rank_step``)."""

from __future__ import annotations

from broker.protocol import Env, shell

# Where the node reads its index (IMDSv2); the request's env or the machine may point
# elsewhere, as with the notice URLs (``providers.bootstrap.agent_env``).
METADATA_URL = (Env.METADATA_AWS_URL, "http://169.254.169.254")

# A node of a multi-node AWS launch: one RunInstances, so one user data for all its instances;
# each adds its ``ami-launch-index`` (0..nodes-1, from IMDSv2) to the launch's first rank. An
# unreadable index fails the script: the exit trap reports the failure (rank unknown: 0).
RANK_STEP = shell(r"""fleet_launch_index() {
  local base="$fleet_metadata" imds index
  local tries=(-fsS -m 5 --retry 5 --retry-delay 1 --retry-connrefused)
  imds=$(curl "${tries[@]}" -X PUT -H 'X-aws-ec2-metadata-token-ttl-seconds: 300' \
      "$base/latest/api/token") &&
    index=$(curl "${tries[@]}" -H "X-aws-ec2-metadata-token: $imds" \
      "$base/latest/meta-data/ami-launch-index") &&
    case "$index" in ''|*[!0-9]*) false ;; esac || {
      echo "fleet: cannot read this instance's ami-launch-index from $base (IMDSv2): its node" \
        "rank is unknown; the instance must allow metadata access (HttpEndpoint enabled)" >&2
      return 1
    }
  echo "$index"
}
if [ -z "${@NODE_RANK:-}" ]; then
  fleet_index=$(fleet_launch_index)
  export @NODE_RANK=$((@FIRST_RANK + fleet_index))
fi
""")


def rank_step() -> str:
    variable, url = METADATA_URL
    return f"fleet_metadata=${{{variable}:-{url}}}\n{RANK_STEP}"
