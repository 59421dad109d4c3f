"""hsx cluster: the Ray session every Ray-using command shares — `hsx run` and the other jobs (jobs/) and `hsx serve`
(serve/) connect through it. It sits below both and imports no other hsx package.

    session.py   ray_cluster(address, quiet=): the session's Ray, an address (probed first) or a private local Ray;
                 ray_logs_dir(), gpus_default(), check_fits(problems, ...), first_line(error)
    console.py   core_echo_off(): the quiet console's filter of Ray's C++ core lines (fatal lines still pass)
    progress.py  what the user watches of a job: the live progress bar (hsx regenerate's too), the end summary,
                 human_bytes / human_count

Ray is imported inside the functions that need it: `import cluster.session` is cheap. Never imports torch or
transformers.
"""
