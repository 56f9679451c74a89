"""Reports (level 5): the offline comparison table and curves (offline.py) and the online
loop's (online.py), from cached artifacts; the statistics over seeds they print (stats.py:
t-intervals, paired differences, stalls, the bimodal rule) and the cell-by-cell comparisons
built on them (compare.py). Imports levels 0-4.
"""
