#!/bin/bash
# Shows the first lines of the sales file.
head -n "${1:-5}" /app/sales.csv
