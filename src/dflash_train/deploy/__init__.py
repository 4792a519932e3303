"""Safe code deploy to a running job, locally or through a chain of hops.

    from dflash_train.deploy.transport import Transport, Hop, parse_hop, TransportError
        Transport.from_via(["ssh://root@host", "pct:200"])
        .run(argv, timeout, input=None, env=None, cwd=None) -> CompletedProcess (text)
        .spawn_detached(argv, log_path, env=None, cwd="/") -> far-end pid (setsid + nohup, stdin /dev/null)
        .copy_dir(local_dir, far_dest)      # tar c | <chain> tar x -C far_dest
        .send_tar(producer_argv, far_dest)  # e.g. git archive
    from dflash_train.deploy.remote import remote_call, remote_run, remote_json
        remote_call(via, ["status", RUN_DIR, "--json"]) -> exit code (far side's output printed here)
    from dflash_train.deploy.command import deploy_command   # `dflash-train deploy`

Far-end helpers sent on stdin (standard library only, never imported from
the deploying code on the far side): agent.py (run.json/liveness, stop,
releases, health) and preflight.py (runs in the NEW code's interpreter).
Environment: DFLASH_SSH_OPTIONS (extra ssh options, e.g. "-F cfg"),
DFLASH_SSH_CONNECT_TIMEOUT (s, default 10), DFLASH_REMOTE_PYTHON (far-end
python for the agent and for status/stop), DFLASH_REMOTE_CLI (full far-end
dflash-train command), DFLASH_DEPLOY_KEEP_RELEASES (default 10).
"""
