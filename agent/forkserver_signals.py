"""Imported only inside the multiprocessing forkserver that starts the trial workers (the first
entry of agent/loop.py's PRELOAD): a SIGTERM to the whole process group (`timeout`,
`kill -- -PGID`, a batch scheduler) must not end the server. The campaign reads a worker's
liveness through it, so its death reads as the death of every worker (exit code 255), and
a campaign that was only asked to stop recorded a crash or failed. The server still ends with
the campaign, which holds the other end of its lifeline pipe; SIGINT it already ignores."""

import signal

signal.signal(signal.SIGTERM, signal.SIG_IGN)
