"""Reports (level 5): the offline comparison table and curves (offline.py) and the online
loop's (online.py), from cached artifacts. Imports levels 0-4.
"""
