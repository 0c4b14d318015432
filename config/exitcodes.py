"""Every exit status the daemon can end with, in one place (sysexits.h where one fits).
``docs/operating.md`` and the systemd unit (``RestartPreventExitStatus``) rely on them."""

EXIT_OK = 0
EXIT_FAILED = 3  # the restart budget is spent, or the first engine could not start
EXIT_UNAVAILABLE = 69  # EX_UNAVAILABLE: the HTTP port is taken
EXIT_RAY_LOST = 75  # EX_TEMPFAIL: the Ray cluster was lost and did not come back in time
EXIT_CONFIG = 78  # EX_CONFIG: invalid configuration (systemd shows it as "CONFIG"), before Ray starts
