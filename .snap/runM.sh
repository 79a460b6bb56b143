#!/bin/bash
cd .snap
B=/root/bL
cmake --build $B -j16 --target tandem_moe_gpu_tests > /tmp/b.log 2>&1 || { grep -m5 -A5 error /tmp/b.log; exit 1; }
T=$(find $B -name tandem_moe_gpu_tests -type f -executable | head -1)
timeout 40 $T -tc="*refused before submission*" 2>&1 | grep -E "logged|test cases|Status" | cut -c1-600
