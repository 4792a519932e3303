"""Run control: the run.json live record, signal handling, status / stop / profile.

    from dflash_train.control.signals import StopController, AbortRun, ignore_stop_signals,
                                             worker_init_ignore_signals, grace_warning
    from dflash_train.control.commands import status_command, stop_command, status_info, stop_run
    from dflash_train.control.profile import profile_command

Submodules are imported lazily by callers (this package imports nothing heavy).
"""
