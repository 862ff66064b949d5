"""On PYTHONPATH, every Python process (engine schedulers included) dumps all thread stacks to stderr on SIGUSR1
(``pkill -USR1 -f <pattern>``): to see where a GPU engine that prints nothing is."""

import faulthandler
import signal

faulthandler.register(signal.SIGUSR1, all_threads=True)
