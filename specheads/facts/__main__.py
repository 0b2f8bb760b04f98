from specheads.facts import main

raise SystemExit(main())
