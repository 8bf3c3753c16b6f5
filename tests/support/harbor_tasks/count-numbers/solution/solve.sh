#!/bin/bash
cd /data && cat numbers.txt extra/more.txt | python3 -c "import sys; print(sum(int(l) for l in sys.stdin if l.strip()))" > answer.txt
