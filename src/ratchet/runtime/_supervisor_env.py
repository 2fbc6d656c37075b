"""The environment a supervisor hands its worker, by name only.

A worker (`ratchet run` under `--supervise`) reads these at start-up; keeping them here lets
it do so without importing the supervisor, which an unsupervised run never needs.
"""

STATUS_FD_ENV = "RATCHET_STATUS_FD"
RESOURCE_ID_ENV = "RATCHET_RESOURCE_ID"
SUPERVISOR_PID_ENV = "RATCHET_SUPERVISOR_PID"
REST_TOKEN_ENV = "RATCHET_REST_TOKEN"
