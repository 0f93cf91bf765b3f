#!/bin/sh
# one-command repro: sh /tmp/overread/run.sh   (extra args passed to repro.py, e.g. --n 512)
exec /tmp/overread/venv/bin/python -W ignore::DeprecationWarning /tmp/overread/repro.py "$@"
